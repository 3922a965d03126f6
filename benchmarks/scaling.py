"""How moe_layer's step time (forward + backward) scales with the token count T at a fixed expert
count, and with the expert count E at a fixed number of routed choices T*k, against the ideal
(and the naive GShard layer where its [T, E, C] tensors fit in memory).

    python benchmarks/scaling.py            # writes benchmarks/results/scaling.json
    python benchmarks/scaling.py --smoke

Plots and tables are drawn from the JSON by benchmarks/report.py.  Timed with freed memory kept for
reuse (see _common.retain_freed_memory).
"""
import sys
from typing import Dict, Optional, Sequence

import torch

from _common import config_child, format_table, load_average, measure_rows, parse_args, write_result
from _models import LayerCase, time_case

# T sweep: E = 64 experts of the layer benchmark's 64-expert shape.
TOKEN_SWEEP = dict(M=512, H=256, E=64, k=2, T=[512, 1024, 2048, 4096, 8192, 16384, 32768, 65536])
# E sweep: T * k = 8192 routed choices (k = 1 for a single expert), smaller experts so that
# 1024 of them (and their gradients) fit in memory.
EXPERT_SWEEP = dict(M=256, H=128, choices=8192, E=[1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024])
SMOKE_TOKEN_SWEEP = dict(M=16, H=16, E=4, k=2, T=[32, 64])
SMOKE_EXPERT_SWEEP = dict(M=16, H=8, choices=64, E=[1, 4])


def measure(tokens: int, model_dim: int, hidden: int, experts: int, top_k: int, reps: int,
            sweep: str) -> Dict[str, object]:
    load = load_average()
    row = time_case(LayerCase(tokens, model_dim, hidden, experts, top_k, torch.float32), reps,
                    naive_limit_bytes=1 << 30)
    row.update(sweep=sweep, load_before=load)
    return row


COLUMNS = ["sweep", "T", "E", "k", "M", "H", "C", "layer_ms", "ideal_ms", "naive_ms", "layer/ideal", "naive/layer",
           "tokens_per_s", "extra_fault_mib", "foreign_cpus"]


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, object]:
    args = parse_args(__doc__.splitlines()[0], argv, default_reps=5)
    if config_child(args, measure):
        return {}
    token_sweep = SMOKE_TOKEN_SWEEP if args.smoke else TOKEN_SWEEP
    expert_sweep = SMOKE_EXPERT_SWEEP if args.smoke else EXPERT_SWEEP
    configs = []
    for tokens in token_sweep["T"]:
        configs.append((tokens, token_sweep["M"], token_sweep["H"], token_sweep["E"], token_sweep["k"], args.reps,
                        "tokens"))
    for experts in expert_sweep["E"]:
        top_k = 1 if experts == 1 else 2
        configs.append((expert_sweep["choices"] // top_k, expert_sweep["M"], expert_sweep["H"], experts, top_k,
                        args.reps, "experts"))
    rows = measure_rows(configs, measure, COLUMNS, script=__file__)
    print(format_table(rows, COLUMNS))
    result = {"rows": rows, "reps": args.reps, "columns": COLUMNS, "token_sweep": token_sweep,
              "expert_sweep": expert_sweep}
    write_result(args.out, "scaling", result, args.smoke)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
