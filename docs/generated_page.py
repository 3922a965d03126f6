"""What every docs/generate_*.py script does with the page it renders: write it, or with --check
fail when the file on disk differs (the tests run the check)."""
import sys
from typing import Sequence


def write_or_check(path: str, text: str, argv: Sequence[str], script: str) -> int:
    """Writes `text` to `path`, or with ``--check`` in `argv` returns 1 (naming `script`, which
    regenerates it) when the file holds anything else; 0 otherwise."""
    if "--check" in argv:
        with open(path) as handle:
            if handle.read() != text:
                print(f"{path} is out of date: run python3 {script}", file=sys.stderr)
                return 1
        return 0
    with open(path, "w") as handle:
        handle.write(text)
    return 0
