# Sourced by examples/run_demo.sh (and, through tests/setup_env.sh, by the test scripts): installs
# what building tutel and running its demo need and a fresh machine lacks, then builds the extension
# in place whenever what it is built from changed since the last build.
#   PyTorch (only when none is installed), a C++ compiler (apt), ninja (the parallel build),
#   scikit-learn and numpy (moe_mnist's bundled digits), matplotlib (the demo's loss curve).
# Python packages are pinned and checked by their installed version, not by whether they import.
set -euo pipefail
export MAX_JOBS="${MAX_JOBS:-2}"
PYTHON="${PYTHON:-python3}"
# The PyTorch to install when none is present (a CPU build on the project's machines).
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"

source tests/install_tools.sh  # install_pinned, install_apt

if ! "$PYTHON" -c "import torch" 2>/dev/null; then
  echo "== installing ${TORCH_SPEC} =="
  "$PYTHON" -m pip install -q "${TORCH_SPEC}"
fi
install_pinned ninja==1.13.2 numpy==2.4.6 scikit-learn==1.9.1 matplotlib==3.11.2
command -v g++ >/dev/null || install_apt g++
# Where ccache is installed (tests/setup_env.sh installs it) the build goes through it, its compiler
# links first on PATH: a rebuild of unchanged sources, and the build of a copy of the checkout at
# the same depth below its CCACHE_BASEDIR (the editable-install test), come from its cache.
if command -v ccache >/dev/null; then
  for ccache_links in /usr/lib/ccache /usr/lib64/ccache /usr/local/lib/ccache; do
    if [ -x "${ccache_links}/c++" ]; then export PATH="${ccache_links}:${PATH}"; break; fi
  done
  # Python's compile flags carry -g, with which ccache keys objects by the build directory as well;
  # the paths inside CCACHE_BASEDIR (set per build) are made relative instead.
  export CCACHE_NOHASHDIR=1
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
  if ! CCACHE_BASEDIR="$(pwd)" "$PYTHON" setup.py -q build_ext --inplace --force \
       >build/tutel_extension_build.log 2>&1; then
    tail -n 60 build/tutel_extension_build.log >&2
    echo "!! the tutel extension failed to build (full log: build/tutel_extension_build.log)" >&2
    exit 1
  fi
  echo "$fingerprint" >"$stamp"
fi
"$PYTHON" -c "import tutel" || { echo "!! the tutel extension was built but does not import" >&2; exit 1; }
export PYTHONPATH="$(pwd)${PYTHONPATH:+:${PYTHONPATH}}"
