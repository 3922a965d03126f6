"""Where tutel's decode kernel should hand inference over to the grouped path, measured on a GPU.

``tutel.ops.decode_experts.decode_experts_supported`` sends CUDA inference of gated experts to the
decode kernel (each chosen expert's matrices read once, the gated unit in registers, no tensor cores)
within the kernel's limits (DECODE_MAX_TOKENS tokens) and the line measured for the GPU and dtype
(tutel.ops.decode_lines), and other calls to the grouped path (the choices sorted by expert, grouped
products, the combine).  This script times the two on the same calls, at the published models' layer
shapes (benchmarks/_hf_blocks.py, FULL_SIZES) and token counts up to the kernel's limit, so that the
line can be set where the grouped path starts to win:

    decode   transformers' experts module under experts_implementation="tutel", the kernel wherever its
             limits allow (decode_line_at: no measured line in effect)
    grouped  the same call with the kernel's token limit moved to 0 (decode_line_at), so the grouped
             path runs

Each candidate is timed eager (every call ended by a synchronisation: what a caller waits for) and,
on CUDA, replayed from a captured CUDA graph (CUDA events; launches then cost next to nothing), in
interleaved rounds.  limit_ms: the bytes of the distinct experts the call chooses, read once at the
read bandwidth measured in the same run (_limits.LimitProbes), the floor of a decoding step.
rows_per_expert = T k / E, the quantity the line is about: below a few rows per expert a grouped
product wastes most of its tiles.  decode_vs_grouped: the relative difference of the two outputs
(both in the case's dtype; rounding only).

Per family and dtype, ``lines`` gives the largest T up to which decode is nowhere slower than
grouped (graph replay and eager separately), and the rows per expert there.  ``--apply`` turns a
GPU run's file into the lines tutel chooses by (tutel/ops/decode_lines.json, read by
``decode_experts_supported``), one per device capability and dtype (measured_lines says how).

    python benchmarks/decode_line.py                 # on a GPU: writes benchmarks/results/decode_line_cuda.json
    python benchmarks/decode_line.py --apply benchmarks/results/decode_line_cuda.json   # anywhere: sets the lines
    python benchmarks/decode_line.py --smoke         # tiny blocks on this machine's device (a check that it runs)
"""
import argparse
import contextlib
import json
import os
import sys
import time
from typing import Callable, Dict, Iterator, List, Optional, Sequence

import torch

import tutel.ops.decode_experts as decode_module
from tutel.ops.decode_lines import (LINES_PATH, DecodeLine, device_capability, lines_in_effect, merge_lines,
                                    read_lines, write_lines)

from _common import RESULTS_DIR, format_table, interleaved_medians, present_columns, write_result
from _hf_blocks import FAMILIES, build_block, case_inputs, experts_call, experts_weight_bytes, tutel_backend_name
from _limits import LimitProbes, synchronized
from cuda_timing import graph_replay_fields

DEFAULT_TOKENS = "1,2,4,8,12,16,24,32"
COLUMNS = ["family", "dtype", "T", "k", "E", "rows_per_expert", "decode_taken", "limit_ms", "decode_ms", "grouped_ms",
           "grouped/decode", "decode_graph_ms", "grouped_graph_ms", "grouped_graph/decode_graph",
           "decode_graph/limit", "decode_vs_grouped"]


@contextlib.contextmanager
def decode_line_at(tokens: int) -> Iterator[None]:
    """Inside, the decode kernel takes every call of up to `tokens` tokens that its own limits allow:
    its token limit (tutel.ops.decode_experts.DECODE_MAX_TOKENS) moved to `tokens` and no measured
    line in effect (tutel.ops.decode_lines), so that a run measures both sides of any line."""
    saved = decode_module.DECODE_MAX_TOKENS
    decode_module.DECODE_MAX_TOKENS = tokens
    try:
        with lines_in_effect([]):
            yield
    finally:
        decode_module.DECODE_MAX_TOKENS = saved


def with_line(fn: Callable[[], object], tokens: int) -> Callable[[], object]:
    """`fn` run with the decode line at `tokens`."""
    def run():
        with decode_line_at(tokens):
            return fn()
    return run


def decode_taken(tokens: int, k: int, experts: int, dtype: torch.dtype, device: torch.device, line: int) -> bool:
    """Whether the 'decode' candidate of a case (the line at `line` tokens) runs the decode kernel
    (False on a CPU, where both candidates run the same operator)."""
    with decode_line_at(line):
        return decode_module.decode_experts_supported(tokens, k, dtype, device, experts=experts)


def decode_lines(rows: List[Dict[str, object]], decode_key: str, grouped_key: str) -> Dict[str, object]:
    """From one family's and dtype's rows: the largest T such that at that T and every smaller one
    measured, decode took no longer than grouped (by `decode_key` and `grouped_key`), with the rows per
    expert there; T = 0 when grouped wins already at the smallest T, None when a row lacks a time."""
    ordered = sorted(rows, key=lambda row: row["T"])
    if not ordered or any(row.get(decode_key) is None or row.get(grouped_key) is None for row in ordered):
        return {"T": None, "rows_per_expert": None}
    line = {"T": 0, "rows_per_expert": 0.0}
    for row in ordered:
        if row[decode_key] > row[grouped_key]:
            break
        line = {"T": row["T"], "rows_per_expert": row["rows_per_expert"]}
    return line


def _relative_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _outputs(block, ours: str, x, indices, weights, line: int) -> torch.Tensor:
    block.config._experts_implementation = ours
    with torch.no_grad(), decode_line_at(line):
        return block.experts(x, indices, weights)


def measure_case(block, ours: str, tokens: int, reps: int, smoke: bool) -> Dict[str, object]:
    """One case's row: eager and graph-replay times of both candidates, the limit, the ratios."""
    experts = block.experts
    device, dtype = experts.down_proj.device, experts.down_proj.dtype
    x, indices, weights, _ = case_inputs(block, tokens, train=False)
    k, num_experts = indices.shape[1], experts.gate_up_proj.shape[0]
    line = decode_module.DECODE_MAX_TOKENS
    call = experts_call(block, ours, x, indices, weights, False, None)
    calls = {"decode": with_line(call, line), "grouped": with_line(call, 0)}
    probes = LimitProbes(dtype, smoke, str(device))
    candidates = {name: synchronized(fn, device) for name, fn in calls.items()}
    candidates.update(probes.candidates())
    times = interleaved_medians(candidates, reps, warmup=1)
    read_bytes = probes.rates(times)["read_bytes"]
    active = int(torch.unique(indices).numel())
    limit_ms = active * experts_weight_bytes(experts)["per_expert"] / read_bytes * 1e3
    row: Dict[str, object] = dict(family=block.name, dtype=str(dtype).replace("torch.", ""), T=tokens, k=k,
                                  E=num_experts, rows_per_expert=tokens * k / num_experts,
                                  decode_taken=decode_taken(tokens, k, num_experts, dtype, device, line),
                                  active_experts=active,
                                  limit_ms=limit_ms, decode_ms=times["decode"] * 1e3, grouped_ms=times["grouped"] * 1e3)
    row["grouped/decode"] = times["grouped"] / times["decode"]
    row["decode_vs_grouped"] = _relative_difference(_outputs(block, ours, x, indices, weights, line),
                                                    _outputs(block, ours, x, indices, weights, 0))
    row.update(graph_fields(calls, reps, limit_ms) if device.type == "cuda" else
               {"decode_graph_ms": None, "grouped_graph_ms": None})
    return row


def graph_fields(calls: Dict[str, Callable[[], object]], reps: int, limit_ms: float) -> Dict[str, object]:
    """cuda_timing.graph_replay_fields of both candidates (None and <name>_graph_error where a
    capture failed), their ratio and decode's against the limit."""
    fields = graph_replay_fields(calls, reps)
    decode_ms, grouped_ms = fields["decode_graph_ms"], fields["grouped_graph_ms"]
    fields["grouped_graph/decode_graph"] = grouped_ms / decode_ms if decode_ms and grouped_ms else None
    fields["decode_graph/limit"] = decode_ms / limit_ms if decode_ms else None
    return fields


def line_summary(rows: List[Dict[str, object]]) -> List[Dict[str, object]]:
    """decode_lines per family and dtype, eager and under graph replay."""
    groups: Dict[tuple, List[Dict[str, object]]] = {}
    for row in rows:
        groups.setdefault((row["family"], row["dtype"]), []).append(row)
    summary = []
    for (family, dtype), group in groups.items():
        eager = decode_lines(group, "decode_ms", "grouped_ms")
        graph = decode_lines(group, "decode_graph_ms", "grouped_graph_ms")
        summary.append(dict(family=family, dtype=dtype, k=group[0]["k"], E=group[0]["E"],
                            measured_T=max(row["T"] for row in group), eager_line_T=eager["T"],
                            eager_line_rows_per_expert=eager["rows_per_expert"], graph_line_T=graph["T"],
                            graph_line_rows_per_expert=graph["rows_per_expert"]))
    return summary


def measured_lines(payload: Dict[str, object], name: str) -> List[DecodeLine]:
    """The lines a GPU run's results (`payload`, read from the file `name`) put between the decode
    kernel and the grouped path, one per dtype measured, for the run's device capability.

    A family's line is the smaller of its eager and graph-replay lines (decode_lines: the kernel
    nowhere slower in either), in rows per expert.  A family whose kernel was nowhere slower at
    every T measured bounds nothing; the dtype's line is the least of the others' (so the kernel
    takes no measured shape where the grouped path was faster), or no bound (None) when every
    family's kernel was nowhere slower.  ValueError for a run that cannot set a line: not on CUDA,
    tiny blocks (--smoke), or a family without a line (a time missing: a capture that failed)."""
    if payload.get("smoke") or not payload.get("capability"):
        raise ValueError(f"{name}: lines come from a full-size run on a CUDA device (not --smoke), "
                         f"which records the device's capability")
    bounds: Dict[str, List[float]] = {}
    for family in payload["lines"]:
        eager, graph = family["eager_line_T"], family["graph_line_T"]
        if eager is None or graph is None:
            raise ValueError(f"{name}: {family['family']} ({family['dtype']}) has no line: a time is missing "
                             f"(a failed capture?); no line is set from this run")
        lowest = min((eager, family["eager_line_rows_per_expert"]), (graph, family["graph_line_rows_per_expert"]))
        bounds.setdefault(family["dtype"], [])
        if lowest[0] < family["measured_T"]:  # the grouped path won within the range measured
            bounds[family["dtype"]].append(lowest[1])
    source = f"{name}, finished {payload.get('finished')}: {payload.get('command')}"
    return [DecodeLine(capability=payload["capability"], dtype=dtype, max_rows_per_expert=min(rows) if rows else None,
                       device_name=payload.get("device_name") or payload["capability"], source=source)
            for dtype, rows in sorted(bounds.items())]


def apply_results(results_path: str, lines_path: str = LINES_PATH) -> List[DecodeLine]:
    """Sets the lines of the run in `results_path` (measured_lines) in the file at `lines_path`,
    each replacing the line of its device capability and dtype; returns them."""
    with open(results_path) as handle:
        payload = json.load(handle)
    repository = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    lines = measured_lines(payload, os.path.relpath(os.path.abspath(results_path), repository))
    write_lines(merge_lines(read_lines(lines_path), lines).values(), lines_path)
    return lines


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--dtypes", default="bfloat16")
    parser.add_argument("--tokens", default=DEFAULT_TOKENS)
    parser.add_argument("--reps", type=int, default=None, help="interleaved rounds per case (default 30, smoke 2)")
    parser.add_argument("--out", default=RESULTS_DIR, help="directory for decode_line_<device>.json")
    parser.add_argument("--smoke", action="store_true", help="tiny blocks (a check that the script runs)")
    parser.add_argument("--apply", metavar="RESULTS", help="measure nothing: set the lines of a GPU run's results "
                        "file in --lines")
    parser.add_argument("--lines", default=LINES_PATH, help="the lines file --apply writes (default: tutel's own)")
    args = parser.parse_args(argv)
    if args.apply:
        lines = apply_results(args.apply, args.lines)
        print(format_table([line._asdict() for line in lines], list(DecodeLine._fields)))
        print(f"wrote {os.path.relpath(args.lines)}")
        return dict(applied=[line._asdict() for line in lines])
    reps = args.reps or (2 if args.smoke else 30)
    device = torch.device(args.device)
    ours = tutel_backend_name()
    rows: List[Dict[str, object]] = []
    started = time.time()
    for family in args.families.split(","):
        for dtype_name in args.dtypes.split(","):
            block = build_block(family, getattr(torch, dtype_name), smoke=args.smoke, device=str(device),
                                full_size=not args.smoke)
            for tokens in (int(t) for t in args.tokens.split(",")):
                rows.append(measure_case(block, ours, tokens, reps, args.smoke))
                print(format_table(rows[-1:], present_columns(rows[-1:], COLUMNS)), file=sys.stderr, flush=True)
            del block
            if device.type == "cuda":
                torch.cuda.empty_cache()
    summary = line_summary(rows)
    payload = dict(rows=rows, columns=COLUMNS, lines=summary, decode_max_tokens=decode_module.DECODE_MAX_TOKENS,
                   device=str(device), capability=device_capability(device), seconds=time.time() - started, reps=reps,
                   device_name=torch.cuda.get_device_name(device) if device.type == "cuda" else None,
                   command="python benchmarks/decode_line.py " + " ".join(sys.argv[1:] if argv is None else argv))
    path = write_result(args.out, f"decode_line_{device.type}", payload, args.smoke)
    print(format_table(rows, present_columns(rows, COLUMNS)))
    print()
    print(format_table(summary, list(summary[0]) if summary else []))
    print(f"wrote {os.path.relpath(path)}")
    return payload


if __name__ == "__main__":
    main()
