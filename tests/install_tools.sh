# Sourced by tests/setup_build.sh and tests/setup_env.sh: how the set-up scripts install what a
# machine lacks.  Python packages are pinned and checked by their installed version, not by whether
# they import; Debian packages come from apt (as root, or through sudo).
PYTHON="${PYTHON:-python3}"

as_root() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }

# install_pinned NAME==VERSION...: pip-installs those whose installed version is not the pinned one.
install_pinned() {
  local wrong
  mapfile -t wrong < <("$PYTHON" - "$@" <<'EOF'
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
}

# install_apt PACKAGE...: apt-installs the given Debian packages (callers pass only missing ones).
install_apt() {
  [ "$#" -gt 0 ] || return 0
  echo "== installing $* (apt) =="
  as_root apt-get update -qq
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
}
