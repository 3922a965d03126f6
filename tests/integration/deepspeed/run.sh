#!/usr/bin/env bash
# DeepSpeed integration: DeepSpeed's MoE layer with use_tutel=True runs on this
# package and computes what use_tutel=False computes.
#
#   bash tests/integration/deepspeed/run.sh
#
# 1. The calls DeepSpeed makes, made directly (needs no DeepSpeed; always runs).
# 2. For each pinned DeepSpeed release: install it into build/integration/ unless
#    it is there already (CPU, no op builds, never a PyTorch: --no-deps plus its
#    light requirements, pinned), then run the equality tests against it.
#
# Exits non-zero when a test fails or a pinned release cannot be installed (its
# equality tests could not run, so the integration is not tested).
set -uo pipefail
cd "$(dirname "$0")/../../.."
ROOT="$(pwd)"
PYTHON="${PYTHON:-python3}"
HERE=tests/integration/deepspeed

# 0.19.x routes top-1, top-2 and top-k gates through tutel; 0.18.9 is the last
# release of the older design (tutel for top-1 gates only, dense einsums otherwise).
DEEPSPEED_VERSIONS="${TUTEL_DEEPSPEED_VERSIONS:-0.19.8 0.18.9}"
# DeepSpeed's requirements that this project's environment does not bring.
LIGHT_REQUIREMENTS=(einops==0.8.2 hjson==3.1.0 msgpack==1.2.4 psutil==7.2.2 tqdm==4.70.1)
# DeepSpeed requirements usually present; installed (pinned) only when missing.
declare -A WHEN_MISSING=([packaging]=packaging==26.2 [cpuinfo]=py-cpuinfo==9.0.0 [pydantic]=pydantic==2.13.4
                         [numpy]=numpy==2.4.6)
INSTALL_TIMEOUT="${TUTEL_DEEPSPEED_INSTALL_TIMEOUT:-240}"
TEST_TIMEOUT="${TUTEL_DEEPSPEED_TEST_TIMEOUT:-300}"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore

if ! PYTHONPATH="${ROOT}${PYTHONPATH:+:${PYTHONPATH}}" "$PYTHON" -c "import tutel.moe" 2>/dev/null; then
  source tests/setup_env.sh
fi
export PYTHONPATH="${ROOT}${PYTHONPATH:+:${PYTHONPATH}}"

failures=()
not_installed=()
tested=()

echo "== DeepSpeed integration: the calls DeepSpeed makes (no DeepSpeed needed) =="
timeout "$TEST_TIMEOUT" "$PYTHON" -m pytest -q -p no:cacheprovider "$HERE/test_deepspeed_call_sequence.py" \
  || failures+=("call sequence")

# Installs deepspeed==$1 into $2 (atomically: a half-finished install is never reused).
install_deepspeed() {
  local version="$1" target="$2" staging="$2.partial" extra=()
  rm -rf "$staging"
  for module in "${!WHEN_MISSING[@]}"; do
    "$PYTHON" -c "import ${module}" 2>/dev/null || extra+=("${WHEN_MISSING[$module]}")
  done
  echo "installing deepspeed==${version} ${LIGHT_REQUIREMENTS[*]} ${extra[*]} into ${target}"
  # DS_BUILD_OPS=0: no C++/CUDA op is compiled at install time.
  DS_BUILD_OPS=0 timeout "$INSTALL_TIMEOUT" "$PYTHON" -m pip install -q --no-deps --target "$staging" \
    "deepspeed==${version}" "${LIGHT_REQUIREMENTS[@]}" || { rm -rf "$staging"; return 1; }
  if [ "${#extra[@]}" -gt 0 ]; then
    # These pull only their own small dependencies (none of them needs PyTorch).
    timeout "$INSTALL_TIMEOUT" "$PYTHON" -m pip install -q --target "$staging" "${extra[@]}" \
      || { rm -rf "$staging"; return 1; }
  fi
  rm -rf "$target" && mv "$staging" "$target"
}

for version in $DEEPSPEED_VERSIONS; do
  target="build/integration/deepspeed-${version}"
  echo "== DeepSpeed ${version}: use_tutel=True equals use_tutel=False =="
  if [ ! -d "${target}/deepspeed-${version}.dist-info" ] && ! install_deepspeed "$version" "$ROOT/$target"; then
    echo "!! deepspeed==${version} could not be installed from the package index: its equality tests did NOT run" >&2
    not_installed+=("$version")
    failures+=("deepspeed ${version} (not installed)")
    continue
  fi
  # DS_ACCELERATOR=cpu: no GPU probing.  DeepSpeed compiles its small shared-memory
  # communication op on first use; it is cached next to the install.
  # A build killed by a timeout leaves torch's build lock behind, on which every later run
  # would wait forever; this script runs alone, so any lock there now is stale.
  rm -f "${ROOT}/${target}-extensions"/*/lock
  PYTHONPATH="${PYTHONPATH}:${ROOT}/${target}" DS_ACCELERATOR=cpu DS_BUILD_OPS=0 \
    TORCH_EXTENSIONS_DIR="${ROOT}/${target}-extensions" \
    timeout "$TEST_TIMEOUT" "$PYTHON" -m pytest -q -p no:cacheprovider -rs \
      "$HERE/test_deepspeed_moe_equality.py" "$HERE/test_deepspeed_doc_example.py" \
    && tested+=("$version") || failures+=("deepspeed ${version}")
done

echo "== DeepSpeed integration summary (${SECONDS}s) =="
echo "equality tested with DeepSpeed: ${tested[*]:-none}"
if [ "${#not_installed[@]}" -gt 0 ]; then
  echo "!! NOT TESTED (install failed): DeepSpeed ${not_installed[*]}" >&2
fi
if [ "${#failures[@]}" -gt 0 ]; then
  echo "!! FAILED: ${failures[*]}" >&2
  exit 1
fi
