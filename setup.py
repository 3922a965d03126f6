"""Builds the tutel package and its compiled extension against the installed PyTorch.

    pip install --no-build-isolation .        # or: pip install --no-build-isolation -e .

`--no-build-isolation` matters: the extension must be compiled against the very
PyTorch that will import it, not against a fresh copy pip would download.

With a CUDA build of PyTorch and a CUDA toolkit's headers and runtime library
(found through CUDA_HOME) the CUDA operators are built too; without them the
build is CPU-only and says why.  TUTEL_WITH_CUDA=1 insists on them (an error
naming what is missing) and TUTEL_WITH_CUDA=0 leaves them out.  Their kernels
are compiled at run time by NVRTC, so the build itself needs no nvcc.

The supported PyTorch releases are in tutel/torch_versions.py; an older one
stops the build at once.
"""
import glob
import importlib.util
import os
import runpy
import sys

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))

try:
    import torch
    from torch.utils import cpp_extension
    from torch.utils.cpp_extension import BuildExtension, CppExtension
except ImportError:  # pragma: no cover - only reached on a machine without torch
    sys.exit(
        "tutel compiles against the installed PyTorch, but `import torch` failed.\n"
        "Install PyTorch first (https://pytorch.org), then run\n"
        "    pip install --no-build-isolation .\n"
        "(--no-build-isolation lets the build see that PyTorch.)"
    )


def relative_sources(*patterns):
    """Source files matching the patterns, relative to this file (setuptools wants relative paths)."""
    found = []
    for pattern in patterns:
        found.extend(sorted(glob.glob(os.path.join(ROOT, pattern))))
    return [os.path.relpath(path, ROOT) for path in found]


def torch_versions():
    """tutel/torch_versions.py's names (the supported PyTorch releases), read without importing tutel."""
    return runpy.run_path(os.path.join(ROOT, "tutel", "torch_versions.py"))


def missing_cuda_files(cuda_home):
    """What building the CUDA host code needs under `cuda_home` and is not there: the runtime's
    header (c10's CUDA stream headers include it) and the runtime library CUDAExtension links."""
    missing = []
    if not os.path.isfile(os.path.join(cuda_home, "include", "cuda_runtime_api.h")):
        missing.append(os.path.join(cuda_home, "include", "cuda_runtime_api.h"))
    libraries = [os.path.join(cuda_home, folder, name) for folder in ("lib64", "lib")
                 for name in ("libcudart.so", "libcudart.a")]
    if not any(os.path.isfile(path) for path in libraries):
        missing.append(os.path.join(cuda_home, "lib64", "libcudart.so"))
    return missing


def cuda_build_choice(setting, no_cuda, torch_version, torch_cuda, cuda_home):
    """(build the CUDA operators?, a line saying why not, or None).

    `setting` is TUTEL_WITH_CUDA: "1" requires the CUDA operators (a SystemExit naming what is
    missing when they cannot be built), "0" leaves them out, as does the reference's NO_CUDA=1
    (`no_cuda`); by default they are built when PyTorch is a CUDA build (`torch_cuda`, its
    torch.version.cuda) and `cuda_home` (PyTorch's CUDA_HOME) holds the CUDA headers and runtime.
    A CUDA home without them (a bare nvcc on PATH makes PyTorch guess one) builds CPU-only."""
    setting = (setting or "").strip().lower()
    if setting in ("0", "false", "no", "off") or (no_cuda or "0") not in ("", "0"):
        return False, None
    required = setting in ("1", "true", "yes", "on")
    if torch_cuda is None:
        if required:
            sys.exit(f"TUTEL_WITH_CUDA=1, but the installed PyTorch {torch_version} is not a CUDA build "
                     "(torch.version.cuda is None). The CUDA operators run on PyTorch's CUDA streams, so "
                     "install a CUDA build of PyTorch, or unset TUTEL_WITH_CUDA for a CPU-only build.")
        return False, None
    if cuda_home is None:
        problem = "no CUDA toolkit was found"
    else:
        missing = missing_cuda_files(cuda_home)
        problem = f"the CUDA toolkit at CUDA_HOME={cuda_home} lacks {', '.join(missing)}" if missing else None
    if problem is None:
        return True, None
    if required:
        sys.exit(f"TUTEL_WITH_CUDA=1, but {problem}. Set CUDA_HOME to a CUDA toolkit (CUDA {torch_cuda}, as "
                 "PyTorch) with its headers and runtime library, or unset TUTEL_WITH_CUDA for a CPU-only build.")
    return False, (f"tutel: building the CPU operators only: PyTorch {torch_version} is a CUDA build, but {problem}. "
                   "For the CUDA operators set CUDA_HOME to a CUDA toolkit with its headers and runtime library "
                   "(or TUTEL_WITH_CUDA=1 to make this an error).")


def cuda_build_requested():
    """Whether this build compiles the CUDA operators (cuda_build_choice on this machine's facts)."""
    chosen, why_not = cuda_build_choice(os.environ.get("TUTEL_WITH_CUDA"), os.environ.get("NO_CUDA"),
                                        torch.__version__, torch.version.cuda, cpp_extension.CUDA_HOME)
    if why_not:
        print(why_not, file=sys.stderr)
    return chosen


def check_torch_release():
    """Stops the build at once on a PyTorch older than the oldest supported release."""
    versions = torch_versions()
    if not versions["is_supported"](torch.__version__):
        sys.exit(f"tutel needs PyTorch >= {versions['OLDEST']} (tested from {versions['OLDEST']} to "
                 f"{versions['NEWEST_TESTED']}), but it would build against torch {torch.__version__}; "
                 f"upgrade it first: pip install \"{versions['REQUIREMENT']}\"")


def openmp_flags():
    """With PyTorch's OpenMP backend, at::parallel_for expands to `#pragma omp parallel` inside the
    extension's own code: without -fopenmp every kernel would run on one thread.  (The OpenMP
    runtime is the one PyTorch already loaded.)"""
    if sys.platform.startswith("linux") and torch.backends.openmp.is_available():
        return ["-fopenmp"]
    return []


def extension():
    sources = relative_sources("csrc/core/*.cpp", "csrc/gemm/*.cpp", "csrc/ops/*.cpp", "csrc/ops/cpu/*.cpp")
    include_dirs = [os.path.join(ROOT, "csrc")]
    compile_args = {"cxx": ["-O3", "-fvisibility=hidden"] + openmp_flags()}
    if not WITH_CUDA:
        return CppExtension(name="tutel._C", sources=sources, include_dirs=include_dirs,
                            extra_compile_args=compile_args, extra_link_args=openmp_flags())
    # Plain C++ host code: the kernels are compiled by NVRTC at run time, and
    # the extension opens NVRTC and the driver with dlopen.
    return cpp_extension.CUDAExtension(
        name="tutel._C",
        sources=sources + relative_sources("csrc/cuda/*.cpp", "csrc/ops/cuda/*.cpp"),
        include_dirs=include_dirs,
        define_macros=[("TUTEL_WITH_CUDA", None)],
        libraries=["dl"],
        extra_compile_args=compile_args,
        extra_link_args=openmp_flags(),
    )


def load_kernel_embedder():
    spec = importlib.util.spec_from_file_location("embed_kernels", os.path.join(ROOT, "csrc", "cuda", "embed_kernels.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BuildWithKernels(BuildExtension):
    """Embeds kernels/* into a generated source in the build directory before compiling."""

    def build_extensions(self):
        if WITH_CUDA:
            generated = os.path.relpath(os.path.join(self.build_temp, "generated", "kernel_sources.cpp"), ROOT)
            load_kernel_embedder().write_if_changed(os.path.join(ROOT, "kernels"), generated)
            for ext in self.extensions:
                if generated not in ext.sources:
                    ext.sources.append(generated)
        super().build_extensions()


def version():
    about = {}
    with open(os.path.join(ROOT, "tutel", "_version.py")) as handle:
        exec(handle.read(), about)
    return about["__version__"]


# pip's build backend and `python setup.py` run this file as __main__; tests import its functions.
if __name__ == "__main__":
    check_torch_release()
    WITH_CUDA = cuda_build_requested()
    setup(
        name="tutel",
        version=version(),
        description="Fast, correct Mixture-of-Experts layers for PyTorch, drop-in compatible with Microsoft Tutel",
        long_description=open(os.path.join(ROOT, "README.md")).read(),
        long_description_content_type="text/markdown",
        license="MIT",
        python_requires=">=3.8",
        packages=find_packages(include=["tutel", "tutel.*"]),
        # The text tutel.examples.transformers_moe trains on; the decode kernel's measured lines.
        package_data={"tutel.examples": ["data/*.txt"], "tutel.ops": ["decode_lines.json"]},
        ext_modules=[extension()],
        cmdclass={"build_ext": BuildWithKernels.with_options(use_ninja=True)},
        # The oldest PyTorch the test suite passes on (tutel/torch_versions.py); tested up to its NEWEST_TESTED.
        install_requires=[torch_versions()["REQUIREMENT"]],
        # pip install --no-build-isolation ".[examples]": what tutel.examples use besides PyTorch
        # (moe_mnist's bundled digits, progress bars, loss curves).  ".[transformers]": the releases
        # tutel.integrations.transformers supports (its versions.REQUIREMENT).
        extras_require={"examples": ["scikit-learn>=1.3", "tqdm>=4.60", "matplotlib>=3.5"],
                        "transformers": ["transformers>=5.7.0,<6"]},
        zip_safe=False,
    )
