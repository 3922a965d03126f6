"""Where the time of one experts call goes: torch.profiler tables of a transformers MoE block's
experts module under tutel and under transformers' backends, on the same routing.

    python benchmarks/profile_experts.py --device cuda --full-size --family qwen3_moe --tokens 1,2048 --train-tokens 2048

Prints, for each backend and case, the operators sorted by device time (self CPU time on a CPU)
and the number of kernel launches; nothing is written.
"""
import argparse
from typing import List, Optional, Sequence

import torch

import _common  # noqa: F401  (puts the repository root on sys.path)
from _hf_blocks import FAMILIES, build_block, case_inputs, experts_call, tutel_backend_name
from _limits import synchronized


def profile_case(block, backend: str, tokens: int, train: bool, device: torch.device, rows: int) -> str:
    x, indices, weights, grad = case_inputs(block, tokens, train)
    call = experts_call(block, backend, x, indices, weights, train, grad)
    call = synchronized(call, device)
    for _ in range(3):
        call()
    on_gpu = device.type == "cuda"
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if on_gpu else [])
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(5):
            call()
    averages = prof.key_averages()
    sort = "self_device_time_total" if on_gpu else "self_cpu_time_total"
    launches = sum(e.count for e in averages if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx",
                                                          "cudaLaunchKernelExC")) / 5
    syncs = sum(e.count for e in averages if "Synchronize" in e.key or e.key == "cudaMemcpyAsync") / 5
    dtype = str(block.experts.down_proj.dtype).replace("torch.", "")
    header = (f"--- {block.name} {dtype} {'fwd+bwd' if train else 'fwd'} T={tokens} "
              f"backend={backend}: {launches:g} kernel launches, {syncs:g} synchronisations/copies per call")
    return header + "\n" + averages.table(sort_by=sort, row_limit=rows)


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--family", default="qwen3_moe", choices=sorted(FAMILIES))
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--full-size", action="store_true")
    parser.add_argument("--tokens", default="1,2048", help="forward token counts")
    parser.add_argument("--train-tokens", default="", help="forward+backward token counts")
    parser.add_argument("--backends", default="tutel,grouped_mm")
    parser.add_argument("--rows", type=int, default=25, help="operators shown per table")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (_hf_blocks.SMOKE_SIZES)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    tutel_backend_name()  # registers tutel's experts implementation
    block = build_block(args.family, getattr(torch, args.dtype), args.smoke, device=args.device,
                        full_size=args.full_size)
    cases: List[tuple] = [(int(t), False) for t in args.tokens.split(",") if t]
    cases += [(int(t), True) for t in args.train_tokens.split(",") if t]
    for tokens, train in cases:
        for backend in args.backends.split(","):
            print(profile_case(block, backend, tokens, train, device, args.rows), flush=True)


if __name__ == "__main__":
    main()
