"""Writes docs/size-lines.md from the table of size lines in tutel/rules/lines.py.

    python3 docs/generate_size_lines.py            # rewrite docs/size-lines.md
    python3 docs/generate_size_lines.py --check    # exit 1 if docs/size-lines.md is out of date

tests/python/test_size_lines.py runs the check, so the page follows the table.  The module is read
from its file: it imports nothing, so the page is written without PyTorch or a built extension.
"""
import importlib.util
import os
import sys
from types import ModuleType


HERE = os.path.dirname(os.path.abspath(__file__))
OUTPUT = os.path.join(HERE, "size-lines.md")
LINES_SOURCE = os.path.join(os.path.dirname(HERE), "tutel", "rules", "lines.py")

HEADER = """# Size lines

Generated from `tutel/rules/lines.py` by `python3 docs/generate_size_lines.py` (do not edit by hand).

Every fixed size at which tutel's Python code switches from one implementation to another, with
what it decides and where the timings behind it come from: the benchmark that measures the sizes
around the line and the section of [performance.md](performance.md) that reports them.  The C++
side's lines are in `csrc/gemm/policy.h`; the decode kernel's lines per GPU and dtype are data, in
`tutel/ops/decode_lines.json`.
"""


def load_lines() -> ModuleType:
    """tutel/rules/lines.py, loaded from its file."""
    spec = importlib.util.spec_from_file_location("tutel_size_lines", LINES_SOURCE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def render() -> str:
    """The whole page: the header, then the table."""
    return HEADER + "\n" + load_lines().lines_table()


def main(argv) -> int:
    from generated_page import write_or_check  # beside this script

    return write_or_check(OUTPUT, render(), argv, "docs/generate_size_lines.py")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
