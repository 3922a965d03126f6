# Sourced by the test scripts: everything the tests need on a fresh machine.  First what building
# tutel and its demo need (tests/setup_build.sh: PyTorch, compiler, the demo's packages, the
# extension), then the test tools, each Python package at a pinned version.
source tests/install_tools.sh
# ccache before the build, so that the build fills its cache: the editable-install test's build of a
# copy of the checkout then takes its objects from there instead of compiling them all again.
command -v ccache >/dev/null || install_apt ccache
# The tests run on the newest PyTorch release tutel is tested on (NEWEST_TESTED in
# tutel/torch_versions.py; the oldest is tested beside it, tests/integration/torch_oldest/run.sh),
# installed before the build so the extension compiles against it.  PIP_CONSTRAINT=/dev/null for this
# one install: a machine-wide pip constraint (an image capping torch at the release on its disk)
# must not hold the tests back.
TEST_TORCH="torch==$("${PYTHON:-python3}" -c 'import runpy; print(runpy.run_path("tutel/torch_versions.py")["NEWEST_TESTED"])')"
PIP_CONSTRAINT=/dev/null install_pinned "$TEST_TORCH"
source tests/setup_build.sh

# Exact versions, so every machine tests with the same tools (none of them is built against):
#   pytest, pytest-timeout (the per-test limit in CI), pytest-xdist (runs the tests on every core), hypothesis;
#   tqdm: the examples' progress bars (the example tests force them on);
#   transformers: the integration tests (tutel.integrations.transformers) run real model code;
#   nvidia-cuda-nvrtc, nvidia-cuda-runtime and nvidia-cuda-crt: NVRTC and the CUDA headers (nvrtc.h,
#   cuda.h, and crt/host_config.h that cuda_runtime.h includes), so the kernel-compile and CUDA
#   host-compile tests run without a GPU or a CUDA toolkit.
install_pinned pytest==9.0.3 pytest-timeout==2.4.0 pytest-xdist==3.8.0 hypothesis==6.155.2 tqdm==4.70.1 transformers==5.24.0 \
               nvidia-cuda-nvrtc==13.2.86 nvidia-cuda-runtime==13.2.86 nvidia-cuda-crt==13.2.86

need_apt=()
command -v cmake >/dev/null || need_apt+=(cmake)                # the C++ suite (ctest)
[ -f /usr/include/gtest/gtest.h ] || need_apt+=(libgtest-dev)   # GoogleTest
command -v mpiexec >/dev/null || need_apt+=(openmpi-bin)        # the mpiexec launcher tests
install_apt "${need_apt[@]}"
