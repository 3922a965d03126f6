#!/usr/bin/env bash
# Sets up this machine (tests/setup_env.sh: what the build and the demo need, then
# the test tools; README.md lists them), builds the project and runs every test:
# the C++ core suite (ctest, also under ASan/UBSan), the DeepSpeed integration, the
# transformers integration on its oldest supported release, the oldest supported PyTorch, and
# the Python suite (pytest) on the newest.  Safe to run repeatedly; installs only what is missing.
#
#   bash tests/run_all.sh              # everything
#   bash tests/run_all.sh -k routing   # extra arguments go to pytest
set -euo pipefail
cd "$(dirname "$0")/.."
source tests/setup_env.sh

echo "== C++ core: GoogleTest (at ${SECONDS} s) =="
cmake -S . -B build/cpp -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build/cpp -j "${MAX_JOBS}" >/dev/null
ctest --test-dir build/cpp --output-on-failure -j "${MAX_JOBS}"

echo "== C++ core: GoogleTest under AddressSanitizer + UBSan (at ${SECONDS} s) =="
cmake -S . -B build/asan -DCMAKE_BUILD_TYPE=Debug -DTUTEL_SANITIZE=ON >/dev/null
cmake --build build/asan -j "${MAX_JOBS}" >/dev/null
ctest --test-dir build/asan --output-on-failure -j "${MAX_JOBS}"

# A separate step with its own time budget; its verdict is given after the main
# pytest run, which stays the last test runner of this script.
echo "== DeepSpeed integration (tests/integration/deepspeed/run.sh) (at ${SECONDS} s) =="
deepspeed_status=0
timeout "${TUTEL_DEEPSPEED_STEP_TIMEOUT:-600}" bash tests/integration/deepspeed/run.sh || deepspeed_status=$?

# The transformers integration against the oldest supported release (the main pytest run tests
# the newest, which tests/setup_env.sh pins); verdict after pytest as well.
echo "== transformers integration, oldest release (tests/integration/transformers/run.sh) (at ${SECONDS} s) =="
transformers_status=0
timeout "${TUTEL_TRANSFORMERS_STEP_TIMEOUT:-600}" bash tests/integration/transformers/run.sh || transformers_status=$?

# The oldest supported PyTorch, built and tested in an environment of its own (the main pytest run
# tests the newest, which tests/setup_env.sh installs); verdict after pytest as well.
echo "== PyTorch, oldest release (tests/integration/torch_oldest/run.sh) (at ${SECONDS} s) =="
torch_oldest_status=0
timeout "${TUTEL_TORCH_OLDEST_STEP_TIMEOUT:-1200}" bash tests/integration/torch_oldest/run.sh || torch_oldest_status=$?

echo "== Python: pytest on torch $(python3 -c 'import torch; print(torch.__version__)') (at ${SECONDS} s) =="
# A hung test fails after TUTEL_TEST_TIMEOUT seconds (pytest-timeout) instead of eating the CI budget;
# the slowest single tests (pip installs that build the extension) take a few minutes.  The 30
# slowest are listed at the end, where the CI budget goes.  The tests run in TUTEL_TEST_WORKERS
# processes (pytest-xdist; 0 runs them in this one).  --dist worksteal: a worker that runs out of
# tests takes queued ones from the other; with the default `load` the few minute-long tests of
# test_docs_commands.py ended up queued behind one another on one worker while the other sat idle,
# and `loadfile` keeps that whole file on one worker by design.
python3 -m pytest -q -p no:cacheprovider --timeout="${TUTEL_TEST_TIMEOUT:-900}" --durations=30 \
        -n "${TUTEL_TEST_WORKERS:-2}" --dist worksteal tests/python "$@"
[ "$deepspeed_status" -eq 0 ] || { echo "the DeepSpeed integration step failed (exit ${deepspeed_status})" >&2; exit 1; }
[ "$transformers_status" -eq 0 ] || { echo "the transformers integration step failed (exit ${transformers_status})" >&2; exit 1; }
[ "$torch_oldest_status" -eq 0 ] || { echo "the oldest-PyTorch step failed (exit ${torch_oldest_status})" >&2; exit 1; }
