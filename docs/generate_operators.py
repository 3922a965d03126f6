"""Writes docs/operators.md from the registry of operators in tutel/ops/registry.py.

    python3 docs/generate_operators.py            # rewrite docs/operators.md
    python3 docs/generate_operators.py --check    # exit 1 if docs/operators.md is out of date

tests/python/test_operator_registry.py runs the check, so the page follows the registry.  The
schemas are read from the registered operators: writing the page needs the built extension.
"""
import os
import sys


HERE = os.path.dirname(os.path.abspath(__file__))
OUTPUT = os.path.join(HERE, "operators.md")

HEADER = """# Operators

Generated from `tutel/ops/registry.py` by `python3 docs/generate_operators.py` (do not edit by hand).

Every operator registered under `torch.ops.tutel`, with its schema as registered and where each of
its implementations lives: the CPU and CUDA kernels (csrc/ops/, and the NVRTC kernels in
kernels/), the composite one in plain PyTorch (`tutel.ops.composite`, which stands in for the CUDA
kernels where those cannot run or disagree, see [cuda-backend.md](cuda-backend.md)), the fake
kernel that gives torch.compile the output shapes, and the autograd.  Only `tutel.ops` calls them;
the rest of tutel goes through its wrappers (and `tutel.ops.direct` on the paths without
autograd).  The last four are defined in Python over the compiled ones, so that torch.compile
sees one opaque, differentiable call.
"""


def render() -> str:
    """The whole page: the header, then the table and the overlapping operators."""
    sys.path.insert(0, os.path.dirname(HERE))
    from tutel.ops.registry import operator_table

    return HEADER + "\n" + operator_table()


def main(argv) -> int:
    from generated_page import write_or_check  # beside this script

    return write_or_check(OUTPUT, render(), argv, "docs/generate_operators.py")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
