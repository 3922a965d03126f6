"""The experts' grouped matrix product alone, by rows per expert: tutel's grouped operator
(skinny products up to 32 rows, PyTorch's GEMM above) against torch.nn.functional.grouped_mm and
one F.linear per expert (what transformers' 'eager' experts do), fp32 and bf16.

Shape: one Qwen3-MoE-like gate+up projection, 64 experts of [1024 outputs, 1024 inputs]; with r
rows per expert, 8 experts are active for r < 8 (decoding: top-8 of one token) and all 64
otherwise.  Limits measured as interleaved candidates: the GEMM rate of a large F.linear in the
dtype, and the read bandwidth of a buffer 8x the last-level cache; limit = the larger of the
FLOPs at that rate and the active weights' bytes at that bandwidth.

    python benchmarks/grouped_gemm.py            # writes benchmarks/results/grouped_gemm.json
    python benchmarks/grouped_gemm.py --smoke
"""
import sys
from typing import Dict, List, Optional, Sequence

import torch
import torch.nn.functional as F

from _common import format_table, interleaved_medians, load_average, parse_args, write_result
from _limits import LimitProbes

import tutel  # noqa: F401  (loads the operators)

ROWS_PER_EXPERT = (1, 2, 4, 8, 16, 32, 64, 256)
SMOKE_ROWS_PER_EXPERT = (1, 3, 40)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
EXPERTS, OUTPUTS, INNER = 64, 1024, 1024
SMOKE_EXPERTS, SMOKE_OUTPUTS, SMOKE_INNER = 8, 48, 40
DECODE_ACTIVE = 8  # experts used below 8 rows per expert (one token's top-8)


def _case(dtype_name: str, rows_per_expert: int, smoke: bool, reps: int) -> Dict[str, object]:
    dtype = DTYPES[dtype_name]
    experts, outputs, inner = (SMOKE_EXPERTS, SMOKE_OUTPUTS, SMOKE_INNER) if smoke else (EXPERTS, OUTPUTS, INNER)
    active = min(experts, DECODE_ACTIVE) if rows_per_expert < 8 else experts
    counts = [0] * experts
    for e in range(active):
        counts[e * (experts // active)] = rows_per_expert
    generator = torch.Generator().manual_seed(rows_per_expert)
    weight = torch.randn(experts, outputs, inner, generator=generator).to(dtype)  # F.linear layout
    x = torch.randn(sum(counts), inner, generator=generator).to(dtype)
    ends = torch.tensor(counts).cumsum(0).to(torch.int32)
    starts = [int(end) - count for end, count in zip(ends.tolist(), counts)]
    right = weight.transpose(1, 2)

    def per_expert_linear():
        out = x.new_empty(x.shape[0], outputs)
        for e, (start, count) in enumerate(zip(starts, counts)):
            if count:
                out[start:start + count] = F.linear(x[start:start + count], weight[e])
        return out

    candidates = {
        "tutel": lambda: torch.ops.tutel.grouped_linear(x, weight, None, counts, True),
        "per_expert_linear": per_expert_linear,
    }
    if hasattr(F, "grouped_mm"):  # PyTorch 2.10 and newer; its columns stay empty before
        candidates["grouped_mm"] = lambda: F.grouped_mm(x, right, offs=ends)
    probes = LimitProbes(dtype, smoke)
    candidates.update(probes.candidates())
    times = interleaved_medians(candidates, reps, warmup=1)
    rates = probes.rates(times)
    flops = 2.0 * x.shape[0] * outputs * inner
    weight_bytes = active * outputs * inner * weight.element_size()
    limit = max(flops / rates["gemm_flops"], weight_bytes / rates["read_bytes"])
    row: Dict[str, object] = dict(dtype=dtype_name, rows_per_expert=rows_per_expert, active_experts=active,
                                  limit_ms=limit * 1e3, gemm_gflops=rates["gemm_flops"] / 1e9,
                                  read_gbps=rates["read_bytes"] / 1e9, load_before=load_average())
    row["tutel_ms"] = times["tutel"] * 1e3
    row["tutel/limit"] = times["tutel"] / limit
    for name in ("grouped_mm", "per_expert_linear"):
        if name in candidates:
            row[f"{name}_ms"] = times[name] * 1e3
            row[f"{name}/tutel"] = times[name] / times["tutel"]
    row["foreign_cpus"] = times.foreign_cpus
    return row


COLUMNS = ["dtype", "rows_per_expert", "active_experts", "tutel_ms", "grouped_mm_ms", "per_expert_linear_ms",
           "limit_ms", "tutel/limit", "grouped_mm/tutel", "per_expert_linear/tutel", "gemm_gflops", "read_gbps"]


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, object]:
    args = parse_args(__doc__.splitlines()[0], argv, default_reps=10)
    rows: List[Dict[str, object]] = []
    for dtype_name in DTYPES:
        for rows_per_expert in (SMOKE_ROWS_PER_EXPERT if args.smoke else ROWS_PER_EXPERT):
            rows.append(_case(dtype_name, rows_per_expert, args.smoke, args.reps))
            print(format_table(rows[-1:], COLUMNS), flush=True)
    payload = {"rows": rows, "columns": COLUMNS}
    path = write_result(args.out, "grouped_gemm", payload, args.smoke)
    print(format_table(rows, COLUMNS))
    print("wrote", path)
    return payload


if __name__ == "__main__":
    main(sys.argv[1:])
