#!/usr/bin/env bash
# The oldest supported PyTorch (OLDEST in tutel/torch_versions.py): the extension built against it,
# and the Python tests run on it.  The main pytest run tests the newest release (NEWEST_TESTED, which
# tests/setup_env.sh installs); this step installs the oldest into a virtual environment of its own
# under build/integration/ (once, pinned; it sees the main environment's test tools), builds a copy
# of the checkout there in place (a second extension, so the main one is left alone) and runs TESTS.
#
#   bash tests/integration/torch_oldest/run.sh            # the files in TESTS
#   bash tests/integration/torch_oldest/run.sh tests/python # every test, as chosen when OLDEST was set
#
# TESTS is a subset, for CI's time (the whole suite would double the Python run): the files that
# touch what changed across the range, each named below with why.  The whole suite passed on OLDEST
# when it was chosen (features this release lacks skipped, each with its reason); run it as above
# when moving the floor.
#
# Exits non-zero when a test fails, or PyTorch could not be installed or the build failed (then
# nothing was tested).
set -uo pipefail
cd "$(dirname "$0")/../../.."
ROOT="$(pwd)"
PYTHON="${PYTHON:-python3}"
export MAX_JOBS="${MAX_JOBS:-2}" PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore

OLDEST="$("$PYTHON" -c 'import runpy; print(runpy.run_path("tutel/torch_versions.py")["OLDEST"])')"
VERSION="${TUTEL_TORCH_OLDEST:-$OLDEST}"
INSTALL_TIMEOUT="${TUTEL_TORCH_OLDEST_INSTALL_TIMEOUT:-420}"
TEST_TIMEOUT="${TUTEL_TORCH_OLDEST_TEST_TIMEOUT:-600}"
TESTS=(tests/python/test_torch_versions.py            # the range, the CUDA choice of setup.py
       tests/python/test_extension_import.py
       tests/python/test_cuda_host_compiles.py         # the CUDA host code against this release's headers
       tests/python/test_gated_units.py                # Python custom operators and their fake kernels
       tests/python/test_grouped_rows_mm.py            # the same, and grouped_mm's absence
       tests/python/test_routed_experts.py             # custom operators under torch.compile
       tests/python/test_compile.py
       tests/python/test_launch_budget.py              # fake CUDA tensors, autograd walked by hand
       tests/python/test_moe_layer.py
       tests/python/distributed/test_dist_collectives.py)  # gloo's collectives (AVG), 2 and 4 processes
[ "$#" -gt 0 ] && TESTS=("$@")

place="build/integration/torch-${VERSION}"
venv="${ROOT}/${place}/venv"
checkout="${ROOT}/${place}/checkout"

# Installs torch==$VERSION into the environment (atomically: a half-finished one is never reused).
install_torch() {
  local staging="${venv}.partial"
  rm -rf "$staging"
  echo "installing torch==${VERSION} into ${place}/venv"
  "$PYTHON" -m venv --system-site-packages "$staging" &&
    timeout "$INSTALL_TIMEOUT" "${staging}/bin/python" -m pip install -q "torch==${VERSION}" ||
    { rm -rf "$staging"; return 1; }
  rm -rf "$venv" && mv "$staging" "$venv"  # run as venv/bin/python -m ...: nothing in it names the staging path
}

status=0
echo "== PyTorch ${VERSION} (the oldest supported): build and tests =="
found="$("${venv}/bin/python" -c 'import torch; print(torch.__version__.split("+")[0])' 2>/dev/null)"
if [ "$found" != "$VERSION" ] && ! install_torch; then
  echo "!! torch==${VERSION} could not be installed from the package index: nothing was tested on it" >&2
  status=1
else
  # The checkout's files (tracked, and untracked ones git does not ignore), fresh each time but for
  # the copy's build/ (its extension is rebuilt: the compiler cache keeps that quick).
  mkdir -p "$checkout" && find "$checkout" -mindepth 1 -maxdepth 1 ! -name build -exec rm -rf {} +
  git ls-files -z --cached --others --exclude-standard |
    tar --null --ignore-failed-read -T - -cf - 2>/dev/null | tar -xf - -C "$checkout"
  # Built and tested in one shell: the build's set-up (the compiler cache on PATH, PYTHONPATH at the
  # copy) holds for the tests too, as in the main run.  setup_build.sh names a failed build itself.
  (cd "$checkout" && export PYTHON="${venv}/bin/python" && source tests/setup_build.sh &&
     timeout "$TEST_TIMEOUT" "$PYTHON" -m pytest -q -p no:cacheprovider -rs --timeout="${TUTEL_TEST_TIMEOUT:-900}" \
       -n "${TUTEL_TEST_WORKERS:-2}" --dist worksteal "${TESTS[@]}") || status=$?
fi

echo "== PyTorch ${VERSION} summary (${SECONDS}s) =="
if [ "$status" -ne 0 ]; then
  echo "!! FAILED: torch ${VERSION} (exit ${status})" >&2
  exit 1
fi
echo "tested with torch ${VERSION}"
