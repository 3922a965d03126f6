#!/usr/bin/env bash
# The transformers integration (experts_implementation="tutel" and replace_moe_blocks) against the
# oldest transformers release it supports.  The newest release is the one tests/setup_env.sh pins,
# and the main pytest run tests it; this step installs the oldest into build/integration/ (once,
# --no-deps, with the few requirements of its own that the main environment's newer transformers
# does not share, all pinned) and runs the integration test files against it.
#
#   bash tests/integration/transformers/run.sh
#
# Exits non-zero when a test fails or the release cannot be installed (then it was not tested).
set -uo pipefail
cd "$(dirname "$0")/../../.."
ROOT="$(pwd)"
PYTHON="${PYTHON:-python3}"

# The oldest supported release (tutel/integrations/transformers/versions.py, OLDEST) and the
# requirements of that release that differ from the newest's: huggingface-hub < 2 (with httpx,
# which hub 2 replaced) and tokenizers <= 0.23.0.
OLDEST_VERSION="${TUTEL_TRANSFORMERS_OLDEST:-5.7.0}"
OWN_REQUIREMENTS=(huggingface-hub==1.33.0 tokenizers==0.22.2 httpx==0.28.1 httpcore==1.0.9)
# Requirements usually present (the newest transformers brings them); installed, pinned, only when missing.
declare -A WHEN_MISSING=([anyio]=anyio==4.16.0 [certifi]=certifi==2026.5.20 [idna]=idna==3.20 [h11]=h11==0.16.0
                         [click]=click==8.5.1 [filelock]=filelock==4.3.1 [fsspec]=fsspec==2026.9.0
                         [hf_xet]=hf-xet==1.8.0 [typing_extensions]=typing-extensions==4.16.0
                         [yaml]=PyYAML==6.0.3 [regex]=regex==2026.5.9 [safetensors]=safetensors==0.8.0
                         [typer]=typer==0.29.2 [packaging]=packaging==26.2 [tqdm]=tqdm==4.70.1)
INSTALL_TIMEOUT="${TUTEL_TRANSFORMERS_INSTALL_TIMEOUT:-240}"
TEST_TIMEOUT="${TUTEL_TRANSFORMERS_TEST_TIMEOUT:-420}"
# The integration's own test files: the experts implementation and replace_moe_blocks.
TESTS=(tests/python/integrations/test_transformers_registration.py
       tests/python/integrations/test_transformers_layouts.py
       tests/python/integrations/test_transformers_families.py
       tests/python/integrations/test_transformers_module_experts.py
       tests/python/integrations/test_transformers_compile.py
       tests/python/integrations/test_transformers_docs.py
       tests/python/integrations/test_transformers_fp8_experts.py
       tests/python/integrations/test_transformers_versions.py
       tests/python/integrations/test_replace_moe_blocks.py)
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore

if ! PYTHONPATH="${ROOT}${PYTHONPATH:+:${PYTHONPATH}}" "$PYTHON" -c "import tutel.moe" 2>/dev/null; then
  source tests/setup_env.sh
fi

# Installs transformers==$1 into $2 (atomically: a half-finished install is never reused).
install_transformers() {
  local version="$1" target="$2" staging="$2.partial" extra=()
  rm -rf "$staging"
  for module in "${!WHEN_MISSING[@]}"; do
    "$PYTHON" -c "import ${module}" 2>/dev/null || extra+=("${WHEN_MISSING[$module]}")
  done
  echo "installing transformers==${version} ${OWN_REQUIREMENTS[*]} ${extra[*]} into ${target}"
  timeout "$INSTALL_TIMEOUT" "$PYTHON" -m pip install -q --no-deps --target "$staging" \
    "transformers==${version}" "${OWN_REQUIREMENTS[@]}" "${extra[@]}" || { rm -rf "$staging"; return 1; }
  rm -rf "$target" && mv "$staging" "$target"
}

target="build/integration/transformers-${OLDEST_VERSION}"
status=0
echo "== transformers ${OLDEST_VERSION} (the oldest supported): the integration tests =="
if [ ! -d "${target}/transformers-${OLDEST_VERSION}.dist-info" ] && ! install_transformers "$OLDEST_VERSION" "$ROOT/$target"; then
  echo "!! transformers==${OLDEST_VERSION} could not be installed from the package index: its tests did NOT run" >&2
  status=1
else
  export PYTHONPATH="${ROOT}/${target}:${ROOT}${PYTHONPATH:+:${PYTHONPATH}}"
  found="$("$PYTHON" -c "import transformers; print(transformers.__version__)" 2>&1)"
  if [ "$found" != "$OLDEST_VERSION" ]; then
    echo "!! the tests would import transformers ${found}, not ${OLDEST_VERSION}" >&2
    status=1
  else
    # -rs lists each skip with its reason ("not in transformers ${OLDEST_VERSION}: ...").
    timeout "$TEST_TIMEOUT" "$PYTHON" -m pytest -q -p no:cacheprovider -rs "${TESTS[@]}" || status=$?
  fi
fi

echo "== transformers integration summary (${SECONDS}s) =="
if [ "$status" -ne 0 ]; then
  echo "!! FAILED: transformers ${OLDEST_VERSION} (exit ${status})" >&2
  exit 1
fi
echo "tested with transformers ${OLDEST_VERSION}"
