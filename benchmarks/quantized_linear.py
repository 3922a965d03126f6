"""The quantized grouped product alone (``tutel.ops.quantized_grouped_linear``: rows grouped by expert
times an MXFP4 / NVFP4 / block-FP8 stack, each work item decoding its strip of weights on the fly)
against tutel's bfloat16 grouped product (``tutel.ops.grouped_mm.grouped_rows_mm``) on the same
weights dequantized to bfloat16 once, up front.

Shape: one gpt-oss-20b-like gate+up projection, E = 4 experts of [N = 5760 outputs, K = 2880
inputs], bfloat16 rows, 16 and 512 rows per expert, at 1 thread and at --threads.  The decoding is
the quantized call's only extra work, so ``{format}/bf16`` (its time over the bfloat16 product's)
is what it costs; the target is 1.10 at 512 rows per expert and at most 1.0 at 16.

The stacks hold random codes and moderate scales: the time does not depend on the values
(tests/python/test_quantized_linear.py holds the values to a float64 reference).

    python benchmarks/quantized_linear.py             # writes benchmarks/results/quantized_linear.json
    python benchmarks/quantized_linear.py --smoke     # tiny shapes, one repetition
"""
import sys
from typing import Dict, List, Optional, Sequence

import torch

from _common import format_table, interleaved_medians, parse_args, write_result

from tutel.ops.grouped_mm import grouped_rows_mm
from tutel.ops.quantized_linear import quantized_grouped_linear
from tutel.quant import Fp8BlockWeights, Mxfp4Weights, Nvfp4Weights, QuantizedWeights

FORMATS = ("mxfp4", "nvfp4", "fp8_block")
FP8_BLOCK = (128, 128)
EXPERTS, OUTPUTS, INNER = 4, 5760, 2880
SMOKE_EXPERTS, SMOKE_OUTPUTS, SMOKE_INNER = 3, 80, 96
ROWS_PER_EXPERT = (16, 512)
SMOKE_ROWS_PER_EXPERT = (3, 40)
#: {format}/bf16 at most this, per rows per expert (the smoke sizes judge nothing).
TARGETS = {16: 1.0, 512: 1.10}
COLUMNS = ["threads", "rows_per_expert", "bf16_ms"] + \
    [column for f in FORMATS for column in (f"{f}_ms", f"{f}/bf16")] + ["foreign_cpus"]


def random_stack(format: str, experts: int, rows: int, cols: int, seed: int) -> QuantizedWeights:
    """A stack of random codes and moderate scales in `format` (no NaN codes or scales)."""
    gen = torch.Generator().manual_seed(seed)
    if format == "fp8_block":
        codes = torch.randint(0, 0x70, (experts, rows, cols), dtype=torch.uint8, generator=gen)
        scales = torch.rand(experts, -(-rows // FP8_BLOCK[0]), -(-cols // FP8_BLOCK[1]), generator=gen) * 1e-3
        return Fp8BlockWeights(codes.view(torch.float8_e4m3fn), scales, block=FP8_BLOCK)
    codes = torch.randint(0, 256, (experts, rows, cols // 2), dtype=torch.uint8, generator=gen)
    if format == "mxfp4":
        return Mxfp4Weights(codes, torch.randint(118, 124, (experts, rows, cols // 32), dtype=torch.uint8,
                                                 generator=gen))
    scales = torch.randint(0x20, 0x40, (experts, rows, cols // 16), dtype=torch.uint8, generator=gen)
    return Nvfp4Weights(codes, scales.view(torch.float8_e4m3fn), torch.rand(experts, generator=gen) * 0.01)


def time_rows(stacks: Dict[str, QuantizedWeights], dense: Dict[str, torch.Tensor], experts: int, inner: int,
              rows_per_expert: int, threads: int, reps: int) -> Dict[str, object]:
    """One row of the table: every candidate at `rows_per_expert` rows per expert on `threads` threads."""
    torch.set_num_threads(threads)
    x = torch.randn(experts * rows_per_expert, inner, generator=torch.Generator().manual_seed(rows_per_expert))
    x = x.to(torch.bfloat16)
    ends = torch.arange(1, experts + 1, dtype=torch.int64) * rows_per_expert
    offsets = ends.to(torch.int32)
    candidates = {}
    for format in FORMATS:
        stack, weight = stacks[format], dense[format]
        candidates[format] = lambda stack=stack: quantized_grouped_linear(x, ends, stack)
        # Each format's own dequantized weights (the bfloat16 product's time does not depend on the
        # values: one of them is timed).
        if format == FORMATS[0]:
            candidates["bf16"] = lambda weight=weight: grouped_rows_mm(x, weight, offsets)
    with torch.inference_mode():
        times = interleaved_medians(candidates, reps, warmup=1)
    row: Dict[str, object] = {"threads": threads, "rows_per_expert": rows_per_expert, "E": experts,
                              "bf16_ms": times["bf16"] * 1e3, "foreign_cpus": times.foreign_cpus}
    for format in FORMATS:
        row[f"{format}_ms"] = times[format] * 1e3
        row[f"{format}/bf16"] = times[format] / times["bf16"]
    return row


def judge(rows: Sequence[Dict[str, object]]) -> List[Dict[str, object]]:
    """Each format's {format}/bf16 against TARGETS, per row."""
    verdicts = []
    for row in rows:
        bound = TARGETS.get(int(row["rows_per_expert"]))
        if bound is None:
            continue
        for format in FORMATS:
            value = row[f"{format}/bf16"]
            verdicts.append({"threads": row["threads"], "rows_per_expert": row["rows_per_expert"],
                             "target": f"{format}/bf16 <= {bound}", "value": value, "met": bool(value <= bound)})
    return verdicts


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, object]:
    args = parse_args(__doc__.splitlines()[0], argv, default_reps=9)
    experts, outputs, inner = (SMOKE_EXPERTS, SMOKE_OUTPUTS, SMOKE_INNER) if args.smoke else (EXPERTS, OUTPUTS, INNER)
    stacks = {f: random_stack(f, experts, outputs, inner, seed=i) for i, f in enumerate(FORMATS)}
    dense = {f: stack.dequantize_reference(torch.float32).to(torch.bfloat16) for f, stack in stacks.items()}
    thread_counts = sorted({1, args.threads})
    rows: List[Dict[str, object]] = []
    for threads in thread_counts:
        for rows_per_expert in (SMOKE_ROWS_PER_EXPERT if args.smoke else ROWS_PER_EXPERT):
            rows.append(time_rows(stacks, dense, experts, inner, rows_per_expert, threads, args.reps))
            print(format_table(rows[-1:], COLUMNS), flush=True)
    torch.set_num_threads(args.threads)
    targets = [] if args.smoke else judge(rows)
    print(format_table(rows, COLUMNS))
    for verdict in targets:
        print(f"threads={verdict['threads']} rows/expert={verdict['rows_per_expert']}: {verdict['target']}: "
              f"{verdict['value']:.3f} ({'met' if verdict['met'] else 'NOT met'})")
    payload = {"rows": rows, "targets": targets, "columns": COLUMNS, "shape": [experts, outputs, inner],
               "fp8_block": list(FP8_BLOCK), "rows_dtype": "bfloat16", "thread_counts": thread_counts}
    path = write_result(args.out, "quantized_linear", payload, args.smoke)
    print("wrote", path)
    return payload


if __name__ == "__main__":
    main(sys.argv[1:])
