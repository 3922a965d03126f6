"""Routing and dispatch micro-benchmarks: achieved GB/s of encode / decode (forward and
backward) against a tensor copy of the same bytes, route_topk time, and the routing metadata's
size against the dense [T, E] masks the reference builds.

Bytes moved count every row read and written (a copy of N bytes moves 2N).  Freed memory is
kept for reuse while timing (see _common.retain_freed_memory), so the figures are the kernels'
own bandwidth, not the operating system's page-fault rate.

    python benchmarks/dispatch.py            # writes benchmarks/results/dispatch.json
    python benchmarks/dispatch.py --smoke
"""
import sys
from typing import Dict, List, Optional, Sequence

import torch

from _common import (format_table, interleaved_medians, load_average, parse_args, peak_memory_mib,
                     retain_freed_memory, use_mmap_for_large_blocks, write_result)
from tutel import ops
from tutel.impls import losses
from tutel.rules.capacity import expert_capacity
from tutel.impls.fast_dispatch import extract_critical

# (T, M, E, k): the layer benchmark's 64-expert shape, and one whose buffers exceed the caches.
SHAPES = [(4096, 512, 64, 2), (16384, 1024, 64, 2)]
SMOKE_SHAPES = [(64, 16, 4, 2)]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
ROUTING_SHAPES = [(4096, 64, 2), (65536, 1024, 2)]
SMOKE_ROUTING_SHAPES = [(64, 8, 2)]
METADATA_SHAPE = (65536, 1024, 2)
SMOKE_METADATA_SHAPE = (256, 16, 2)


def dispatch_rows(shape, dtype_name: str, reps: int) -> List[Dict[str, object]]:
    """One row per kernel: time, bytes moved, GB/s and the fraction of the copy's GB/s."""
    tokens, model_dim, experts, top_k = shape
    dtype = DTYPES[dtype_name]
    routing = ops.route_topk(torch.softmax(torch.randn(tokens, experts), dim=1), top_k)
    capacity = expert_capacity(1.0, top_k, tokens, experts)
    indices, locations, gates = routing.indices, routing.locations, routing.gates.float()
    kept = int((locations < capacity).sum())
    x = torch.randn(tokens, model_dim, dtype=dtype)
    buffer = torch.randn(experts, capacity, model_dim, dtype=dtype)
    copy_target = torch.empty_like(buffer)
    grad_tokens = torch.randn(tokens, model_dim, dtype=dtype)
    row = x.element_size() * model_dim
    slots_bytes, tokens_bytes, kept_bytes = buffer.numel() * x.element_size(), tokens * row, kept * row
    scatter = torch.ops.tutel.scatter_slots
    gather = torch.ops.tutel.gather_slots
    # name: (call, bytes read + written)
    kernels = {
        "copy": (lambda: copy_target.copy_(buffer), 2 * slots_bytes),
        "encode": (lambda: scatter(x, indices, locations, None, None, experts, capacity), kept_bytes + slots_bytes),
        "encode_backward": (lambda: gather(buffer, indices, locations, None, None), kept_bytes + tokens_bytes),
        "decode": (lambda: gather(buffer, indices, locations, gates, None), kept_bytes + tokens_bytes),
        "decode_backward": (lambda: scatter(grad_tokens, indices, locations, gates, buffer, experts, capacity),
                            2 * kept_bytes + slots_bytes),
    }
    times = interleaved_medians({name: call for name, (call, _) in kernels.items()}, reps, warmup=2)
    copy_rate = kernels["copy"][1] / times["copy"]
    rows = []
    for name, (_, moved) in kernels.items():
        rate = moved / times[name]
        rows.append(dict(T=tokens, M=model_dim, E=experts, k=top_k, dtype=dtype_name, kernel=name,
                         ms=times[name] * 1e3, MB_moved=moved / 1e6, GB_per_s=rate / 1e9,
                         of_copy=rate / copy_rate, foreign_cpus=times.foreign_cpus))
    return rows


def routing_rows(shape, reps: int) -> List[Dict[str, object]]:
    tokens, experts, top_k = shape
    scores = torch.softmax(torch.randn(tokens, experts), dim=1)
    calls = {
        "route_topk": lambda: torch.ops.tutel.route_topk(scores, top_k, False),
        "route_topk_bpr": lambda: torch.ops.tutel.route_topk(scores, top_k, True),
        "torch.topk (selection only)": lambda: torch.topk(scores, top_k, dim=1),
    }
    times = interleaved_medians(calls, reps)
    return [dict(T=tokens, E=experts, k=top_k, op=name, ms=seconds * 1e3, foreign_cpus=times.foreign_cpus)
            for name, seconds in times.items()]


def metadata_sizes(shape) -> Dict[str, object]:
    """Bytes of the routing metadata (crit) against k dense float32 [T, E] masks, and the peak
    memory routing adds above its [T, E] input scores."""
    tokens, experts, top_k = shape
    scores = torch.softmax(torch.randn(tokens, experts), dim=1)
    crit, _ = extract_critical(scores, top_k, loss_fn=losses.gshard_loss, capacity_factor=1.0)
    tensors = list(crit.indices_s) + list(crit.locations_s) + list(crit.gates_s) + [crit.dispatch_count]
    metadata = sum(t.numel() * t.element_size() for t in tensors)
    dense = top_k * tokens * experts * 4
    peak = peak_memory_mib(lambda: extract_critical(scores, top_k, loss_fn=losses.gshard_loss, capacity_factor=1.0))
    return dict(T=tokens, E=experts, k=top_k, metadata_bytes=metadata, bytes_per_choice=metadata / (tokens * top_k),
                dense_mask_bytes=dense, dense_over_metadata=dense / metadata, scores_mib=tokens * experts * 4 / 2**20,
                routing_peak_mib=peak)


DISPATCH_COLUMNS = ["T", "M", "E", "k", "dtype", "kernel", "ms", "MB_moved", "GB_per_s", "of_copy", "foreign_cpus"]
ROUTING_COLUMNS = ["T", "E", "k", "op", "ms", "foreign_cpus"]
METADATA_COLUMNS = ["T", "E", "k", "metadata_bytes", "bytes_per_choice", "dense_mask_bytes", "dense_over_metadata",
                    "scores_mib", "routing_peak_mib"]


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, object]:
    args = parse_args(__doc__.splitlines()[0], argv, default_reps=30)
    load_before = load_average()
    # Bandwidth of the kernels themselves: outputs reuse freed memory instead of faulting in
    # fresh pages (the copy writes into a preallocated tensor).
    retain_freed_memory()
    dispatch: List[Dict[str, object]] = []
    for shape in SMOKE_SHAPES if args.smoke else SHAPES:
        for dtype_name in DTYPES:
            dispatch += dispatch_rows(shape, dtype_name, args.reps)
    print(format_table(dispatch, DISPATCH_COLUMNS), flush=True)
    routing: List[Dict[str, object]] = []
    for shape in SMOKE_ROUTING_SHAPES if args.smoke else ROUTING_SHAPES:
        routing += routing_rows(shape, args.reps)
    print(format_table(routing, ROUTING_COLUMNS), flush=True)
    # Memory last: from here on large blocks are mmap'd so the resident set tracks live tensors.
    use_mmap_for_large_blocks()
    metadata = metadata_sizes(SMOKE_METADATA_SHAPE if args.smoke else METADATA_SHAPE)
    print(format_table([metadata], METADATA_COLUMNS))
    result = {"dispatch": dispatch, "routing": routing, "metadata": metadata, "reps": args.reps,
              "load_before": load_before, "columns": {"dispatch": DISPATCH_COLUMNS, "routing": ROUTING_COLUMNS,
                                                      "metadata": METADATA_COLUMNS}}
    write_result(args.out, "dispatch", result, args.smoke)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
