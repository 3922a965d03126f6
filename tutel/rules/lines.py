"""Every size line the Python side chooses an implementation by, in one table.

A size line is a fixed number of rows, tokens or bytes on one side of which one implementation
runs and on the other side another (or none of the two is worth splitting further).  Each row of
``LINES`` names the line, its value and unit, what it decides, and where the timings behind it
come from: the benchmark script that measures the sizes around it and the section of
docs/performance.md that reports them.  The reasons stay here; the figures stay in that page,
where a rerun of the script replaces them, so no comment in the code carries a timing that a
later change could leave stale.

The modules that apply a line import its constant from here (``PIECE_BYTES``, ...), so a line is
set once; tests/python/test_size_lines.py fails on a module that defines a constant of the same
name again, on a script or section that no longer exists, and on docs/size-lines.md when it no
longer shows ``lines_table()``.  The C++ side keeps its own lines in one table as well
(csrc/gemm/policy.h).  The lines measured per GPU and dtype for the decode kernel are data, not
constants: tutel/ops/decode_lines.json (``tutel.ops.decode_lines``); the two decode limits below
bound them.

This module imports nothing, so every layer of tutel may read it (docs/design.md, "Layers of the
code").
"""
import re
from typing import Dict, NamedTuple, Tuple


class SizeLine(NamedTuple):
    """One size line: a threshold between two implementations (or two ways of cutting the work)."""
    name: str  # the module constant that holds `value` (lines.<name>)
    value: int
    unit: str  # what `value` counts
    decides: str  # which side runs what, and why the line lies about here (no figures)
    benchmark: str  # the script measuring the sizes around it, relative to the repository root
    section: str  # the heading of docs/performance.md reporting those measurements


LINES: Tuple[SizeLine, ...] = (
    SizeLine(
        "UPCAST_MIN_ROWS_PER_EXPERT", 32, "rows per expert",
        "From this many rows per expert on, the expert products of bfloat16 or float16 data on a CPU without "
        "native 16-bit dot products run in float32 (operands widened, the product rounded back); below it "
        "widening the weights costs more than PyTorch's slower 16-bit product saves.",
        "benchmarks/transformers_moe.py", "Expert products on the CPU: dtype and operator"),
    SizeLine(
        "TOKEN_LINEAR_MAX_ROWS", 16, "token rows",
        "Up to this many bfloat16 or float16 token rows on the CPU with nothing differentiated, traced or "
        "autocast, a router's product runs on tutel's grouped operator, whose skinny products skip the fixed "
        "cost PyTorch's 16-bit linear pays on every call; past it PyTorch's GEMM is as fast or faster.",
        "benchmarks/transformers_moe.py", "moe_layer inference on the CPU"),
    SizeLine(
        "PIECE_BYTES", 64 << 20, "bytes",
        "Without autograd on the CPU, the experts' grouped rows run in pieces whose up projection takes about "
        "this many bytes, so that no buffer spans every grouped row and memory stays bounded at any number of "
        "tokens.",
        "benchmarks/transformers_moe.py", "Routed experts on the CPU"),
    SizeLine(
        "MIN_PIECE_ROWS", 4096, "grouped rows",
        "A piece holds at least this many grouped rows, so that each expert still has enough rows per "
        "product to keep its GEMM efficient; up to and including this many rows, inference runs in one "
        "operator call, where the calls' fixed costs still matter.",
        "benchmarks/transformers_moe.py", "Routed experts on the CPU"),
    SizeLine(
        "DECODE_MAX_TOKENS", 32, "tokens",
        "Up to and including this many tokens, inference of gated experts on CUDA may take decode_experts' "
        "kernel (the sizes it is made and tested for; within them the line measured per GPU and dtype "
        "decides); more tokens take the grouped path.",
        "benchmarks/decode_line.py", "Routed experts on CUDA"),
    SizeLine(
        "DECODE_MAX_CHOICES", 256, "choices (tokens x k)",
        "Up to and including this many routing choices, decode_experts' kernel may take the call; every "
        "block scans the choices before its own to find its expert's, so that bookkeeping grows with the "
        "square of the choices and a larger call takes the grouped path.",
        "benchmarks/decode_line.py", "Routed experts on CUDA"),
    SizeLine(
        "QUANTIZED_DECODE_MAX_TOKENS", 32, "tokens",
        "Up to and including this many tokens, CPU inference of quantized experts (weight-only, a unit the "
        "operator computes) takes decode_quantized_experts, which streams each chosen expert's packed codes once "
        "(the sizes it is made and tested for); more tokens take the kept rows in pieces, each busy expert's "
        "matrices dequantized once for all its rows.",
        "benchmarks/quantized_experts.py", "Quantized experts at decoding sizes on the CPU"),
)

_BY_NAME: Dict[str, SizeLine] = {line.name: line for line in LINES}


def size_line(name: str) -> SizeLine:
    """The row of `name` (KeyError naming the known lines for another name)."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise KeyError(f"no size line {name!r}; the lines are {sorted(_BY_NAME)}") from None


# The constants the modules apply, each read from its row.
UPCAST_MIN_ROWS_PER_EXPERT = size_line("UPCAST_MIN_ROWS_PER_EXPERT").value
TOKEN_LINEAR_MAX_ROWS = size_line("TOKEN_LINEAR_MAX_ROWS").value
PIECE_BYTES = size_line("PIECE_BYTES").value
MIN_PIECE_ROWS = size_line("MIN_PIECE_ROWS").value
DECODE_MAX_TOKENS = size_line("DECODE_MAX_TOKENS").value
DECODE_MAX_CHOICES = size_line("DECODE_MAX_CHOICES").value
QUANTIZED_DECODE_MAX_TOKENS = size_line("QUANTIZED_DECODE_MAX_TOKENS").value


def heading_anchor(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _shown_value(line: SizeLine) -> str:
    if line.unit == "bytes" and line.value >= 1 << 20 and line.value % (1 << 20) == 0:
        return f"{line.value >> 20} MiB"
    return str(line.value)


def lines_table() -> str:
    """The table as Markdown, one row per line, with links relative to docs/ (docs/size-lines.md)."""
    rows = ["| line | value | unit | what it decides | benchmark | measured in |", "|---|---|---|---|---|---|"]
    for line in LINES:
        script = f"[`{line.benchmark}`](../{line.benchmark})"
        section = f"[{line.section}](performance.md#{heading_anchor(line.section)})"
        rows.append(f"| `{line.name}` | {_shown_value(line)} | {line.unit} | {line.decides} | {script} | {section} |")
    return "\n".join(rows) + "\n"
