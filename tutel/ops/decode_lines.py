"""The measured lines between ``decode_experts``' CUDA kernel and the grouped path, per GPU and dtype.

At decoding sizes both paths read each chosen expert's matrices once; what separates them is the
work done per byte read, T k / E rows per expert.  The decode kernel multiplies on CUDA cores
with no tiles to waste, so it wins while an expert serves a row or a few; a grouped product on
tensor cores wins once the rows per expert fill its tiles.  Where that happens depends on the GPU
(its bandwidth against its CUDA-core rate) and on the dtype, so the line is measured per device
capability and dtype: ``benchmarks/decode_line.py`` times both paths at the published layer shapes
and its ``--apply`` writes the line into ``decode_lines.json`` beside this module, with the device
and the results file it came from.

A line holds ``max_rows_per_expert``: the kernel is chosen while T k <= max_rows_per_expert * E
(``None``: the kernel was nowhere slower up to its own limits).  A device and dtype with no measured
line take the kernel's own limits alone (``tutel.ops.decode_experts.DECODE_MAX_TOKENS`` and
``DECODE_MAX_CHOICES``).
"""
import contextlib
import json
import math
import os
from typing import Dict, Iterable, Iterator, NamedTuple, Optional, Tuple, Union

import torch

from .backend import cuda_capability, fake_mode_active

LINES_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "decode_lines.json")
# What the file says of itself (kept when --apply rewrites it).
ABOUT = ("Measured lines between tutel's decode_experts CUDA kernel and the grouped path (tutel/ops/decode_lines.py); "
         "written by `python benchmarks/decode_line.py --apply <results json>`.")


class DecodeLine(NamedTuple):
    """The line measured on one kind of GPU for one dtype."""
    capability: str  # the device's compute capability, "major.minor" (e.g. "9.0")
    dtype: str  # the data dtype's name (e.g. "bfloat16")
    max_rows_per_expert: Optional[float]  # the kernel while T k / E is at most this; None: up to its limits
    device_name: str  # the GPU it was measured on
    source: str  # the results file and command it came from


LineTable = Dict[Tuple[str, str], DecodeLine]


def _line_from_entry(entry: object, where: str) -> DecodeLine:
    if not isinstance(entry, dict) or set(entry) != set(DecodeLine._fields):
        raise ValueError(f"{where}: an entry must be an object with exactly the fields {list(DecodeLine._fields)}, "
                         f"got {entry!r}")
    for name in ("capability", "dtype", "device_name", "source"):
        if not isinstance(entry[name], str) or not entry[name]:
            raise ValueError(f"{where}: `{name}` must be a non-empty string, got {entry[name]!r}")
    rows = entry["max_rows_per_expert"]
    if rows is not None and (isinstance(rows, bool) or not isinstance(rows, (int, float))
                             or not math.isfinite(rows) or rows < 0):
        raise ValueError(f"{where}: `max_rows_per_expert` must be null or a finite number >= 0, got {rows!r}")
    if not isinstance(getattr(torch, entry["dtype"], None), torch.dtype):
        raise ValueError(f"{where}: `dtype` must name a torch dtype, got {entry['dtype']!r}")
    return DecodeLine(**{**entry, "max_rows_per_expert": None if rows is None else float(rows)})


def read_lines(path: Optional[str] = None) -> LineTable:
    """The lines in the file at `path` (default: the one shipped with tutel, LINES_PATH), by
    (capability, dtype); ValueError naming the file for a malformed one (a line measured twice for
    one device and dtype included)."""
    path = LINES_PATH if path is None else path
    with open(path) as f:
        payload = json.load(f)
    if not isinstance(payload, dict) or not isinstance(payload.get("lines"), list):
        raise ValueError(f"{path}: must be an object with a `lines` list")
    table: LineTable = {}
    for index, entry in enumerate(payload["lines"]):
        line = _line_from_entry(entry, f"{path}: lines[{index}]")
        key = (line.capability, line.dtype)
        if key in table:
            raise ValueError(f"{path}: lines[{index}]: a second line for capability {key[0]} and dtype {key[1]}")
        table[key] = line
    return table


def write_lines(lines: Iterable[DecodeLine], path: Optional[str] = None) -> None:
    """Writes `lines` to `path` (default: the file shipped with tutel, LINES_PATH), sorted by
    capability and dtype, replacing what it held."""
    path = LINES_PATH if path is None else path
    ordered = sorted(lines, key=lambda line: (line.capability, line.dtype))
    payload = {"about": ABOUT, "lines": [line._asdict() for line in ordered]}
    temporary = path + ".tmp"
    with open(temporary, "w") as f:
        json.dump(payload, f, indent=2)
        f.write("\n")
    os.replace(temporary, path)


def merge_lines(table: LineTable, lines: Iterable[DecodeLine]) -> LineTable:
    """`table` with `lines` added, each replacing the line of its capability and dtype."""
    merged = dict(table)
    merged.update(_by_device_and_dtype(lines))
    return merged


def _by_device_and_dtype(lines: Iterable[DecodeLine]) -> LineTable:
    return {(line.capability, line.dtype): line for line in lines}


# Plain module caches rather than functools.lru_cache: calls traced by torch.compile read them too.
_shipped: Optional[LineTable] = None  # the shipped file's lines, read at first use
_lines_override: Optional[LineTable] = None  # set by lines_in_effect
# How many times lines_in_effect changed the lines in effect: callers that keep an answer derived
# from the lines (tutel.impls.call_plans) key it on this count.
overrides = 0
_capabilities: Dict[int, str] = {}  # by CUDA device index


def _lines_now() -> LineTable:
    global _shipped
    if _lines_override is not None:
        return _lines_override
    if _shipped is None:
        _shipped = read_lines()
    return _shipped


@contextlib.contextmanager
def lines_in_effect(lines: Iterable[DecodeLine]) -> Iterator[None]:
    """Inside, `lines` are the lines in effect in place of the shipped file's (a benchmark runs the
    kernel past a measured line with no lines at all; tests set their own)."""
    global _lines_override, overrides
    saved = _lines_override
    _lines_override = _by_device_and_dtype(lines)
    overrides += 1
    try:
        yield
    finally:
        _lines_override = saved
        overrides += 1


def device_capability(device: Union[str, torch.device]) -> Optional[str]:
    """The compute capability ("major.minor") of CUDA `device` as ``tutel.ops.backend.
    cuda_capability`` gives it: the GPU's own, or inside a FakeTensorMode on a PyTorch without CUDA
    the device fake CUDA tensors stand for (FAKE_CUDA_CAPABILITY), so that a trace on the CPU takes
    the line that device takes.  None for another device type, or without CUDA outside a fake mode."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    if not torch.cuda.is_available():
        return "{}.{}".format(*cuda_capability(device)) if fake_mode_active() else None
    index = torch.cuda.current_device() if device.index is None else device.index
    if index not in _capabilities:
        _capabilities[index] = "{}.{}".format(*cuda_capability(torch.device("cuda", index)))
    return _capabilities[index]


def line_for(device: Union[str, torch.device], dtype: torch.dtype) -> Optional[DecodeLine]:
    """The measured line in effect for `dtype` on `device`, or None where none was measured."""
    table = _lines_now()
    capability = device_capability(device) if table else None  # no device query when there is no line
    if capability is None:
        return None
    return table.get((capability, str(dtype).replace("torch.", "")))


def within_line(tokens: int, k: int, experts: Optional[int], dtype: torch.dtype,
                device: Union[str, torch.device]) -> bool:
    """Whether a call of `tokens` tokens with `k` choices each over `experts` experts lies on the
    decode kernel's side of the measured line for `dtype` on `device` (True where no line was
    measured, where the line has no bound, or where `experts` is None: not known to the caller)."""
    line = line_for(device, dtype)
    if line is None or line.max_rows_per_expert is None or experts is None:
        return True
    # T k / E <= rows, compared without dividing (E may be 0 in an empty layer).
    return tokens * k <= line.max_rows_per_expert * experts + 1e-9
