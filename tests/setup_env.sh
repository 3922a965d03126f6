# Sourced by the demo and test scripts: installs what a fresh machine lacks and
# builds the extension in place.  Installs only what is missing.
set -euo pipefail
export MAX_JOBS="${MAX_JOBS:-2}"
PYTHON="${PYTHON:-python3}"
# The PyTorch to install when none is present (a CPU build on the project's machines).
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"

as_root() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }

if ! "$PYTHON" -c "import torch" 2>/dev/null; then
  echo "== installing ${TORCH_SPEC} =="
  "$PYTHON" -m pip install -q "${TORCH_SPEC}"
fi

missing=()
# module[:pip package]; scikit-learn (bundled digits), tqdm and matplotlib serve the examples.
# transformers: the integration tests (tutel.integrations.transformers) run real model code.
for spec in pytest hypothesis ninja numpy sklearn:scikit-learn==1.9.1 tqdm==4.70.1 matplotlib==3.11.2 transformers==5.23.0; do
  module="${spec%%[:=]*}"; package="${spec#*:}"
  "$PYTHON" -c "import ${module}" 2>/dev/null || missing+=("${package}")
done
if [ "${#missing[@]}" -gt 0 ]; then
  echo "== installing ${missing[*]} =="
  "$PYTHON" -m pip install -q "${missing[@]}"
fi

# NVRTC, so that the kernel compile tests run without a GPU or CUDA toolkit.
if ! "$PYTHON" -m pip show -q nvidia-cuda-nvrtc >/dev/null 2>&1; then
  echo "== installing nvidia-cuda-nvrtc =="
  "$PYTHON" -m pip install -q "nvidia-cuda-nvrtc==13.0.*"
fi

need_apt=()
command -v cmake >/dev/null || need_apt+=(cmake)
command -v g++ >/dev/null || need_apt+=(g++)
[ -f /usr/include/gtest/gtest.h ] || need_apt+=(libgtest-dev)
command -v mpiexec >/dev/null || need_apt+=(openmpi-bin)   # the mpiexec launcher tests
if [ "${#need_apt[@]}" -gt 0 ]; then
  echo "== installing ${need_apt[*]} (apt) =="
  as_root apt-get update -qq
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

echo "== building the tutel extension in place =="
"$PYTHON" setup.py -q build_ext --inplace 2>&1 | grep -vE "^(running|copying|creating)|UserWarning|warnings.warn|^$" || true
"$PYTHON" -c "import tutel" || { echo "the tutel extension failed to build" >&2; exit 1; }
export PYTHONPATH="$(pwd)${PYTHONPATH:+:${PYTHONPATH}}"
