# Sourced by the demo and test scripts: installs what a fresh machine lacks (every Python
# package at a pinned version, checked by its installed version, not by whether it imports) and
# builds the extension in place whenever its sources changed since the last build.
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

# Exact versions, so every machine tests with the same tools:
#   pytest, pytest-timeout (the per-test limit in CI), hypothesis, ninja (the extension's build), numpy;
#   scikit-learn (moe_mnist's bundled digits), tqdm and matplotlib: the examples;
#   transformers: the integration tests (tutel.integrations.transformers) run real model code;
#   nvidia-cuda-nvrtc, nvidia-cuda-runtime and nvidia-cuda-crt: NVRTC and the CUDA headers (nvrtc.h,
#   cuda.h, and crt/host_config.h that cuda_runtime.h includes), so the kernel-compile and CUDA
#   host-compile tests run without a GPU or a CUDA toolkit.
PINNED=(pytest==9.0.3 pytest-timeout==2.4.0 hypothesis==6.155.2 ninja==1.13.2 numpy==2.4.6
        scikit-learn==1.9.1 tqdm==4.70.1 matplotlib==3.11.2 transformers==5.23.0
        nvidia-cuda-nvrtc==13.0.88 nvidia-cuda-runtime==13.0.96 nvidia-cuda-crt==13.0.88)
mapfile -t wrong < <("$PYTHON" - "${PINNED[@]}" <<'EOF'
import sys
from importlib import metadata
for spec in sys.argv[1:]:
    name, wanted = spec.split("==")
    try:
        found = metadata.version(name)
    except metadata.PackageNotFoundError:
        found = None
    if found != wanted:
        print(spec)
EOF
)
if [ "${#wrong[@]}" -gt 0 ]; then
  echo "== installing ${wrong[*]} =="
  "$PYTHON" -m pip install -q "${wrong[@]}"
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

# The extension is rebuilt whenever what it is built from changed: the C++ and kernel sources,
# setup.py, or the PyTorch it compiles against (a fingerprint of them sits beside the build).
mkdir -p build
extension_fingerprint() {
  "$PYTHON" - <<'EOF'
import hashlib, pathlib, torch
digest = hashlib.sha256(torch.__version__.encode())
for root in ("csrc", "kernels"):
    for path in sorted(p for p in pathlib.Path(root).rglob("*") if p.is_file()):
        digest.update(str(path).encode() + b"\0" + path.read_bytes())
digest.update(pathlib.Path("setup.py").read_bytes())
print(digest.hexdigest())
EOF
}
fingerprint="$(extension_fingerprint)"
stamp=build/tutel_extension.fingerprint
if ! ls tutel/_C*.so >/dev/null 2>&1 || [ "$(cat "$stamp" 2>/dev/null)" != "$fingerprint" ]; then
  echo "== building the tutel extension in place =="
  rm -f "$stamp"
  if ! "$PYTHON" setup.py -q build_ext --inplace --force >build/tutel_extension_build.log 2>&1; then
    tail -n 60 build/tutel_extension_build.log >&2
    echo "!! the tutel extension failed to build (full log: build/tutel_extension_build.log)" >&2
    exit 1
  fi
  echo "$fingerprint" >"$stamp"
fi
"$PYTHON" -c "import tutel" || { echo "!! the tutel extension was built but does not import" >&2; exit 1; }
export PYTHONPATH="$(pwd)${PYTHONPATH:+:${PYTHONPATH}}"
