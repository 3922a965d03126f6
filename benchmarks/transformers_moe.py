"""tutel against Hugging Face transformers' own experts backends, on transformers' MoE blocks.

For each family (Qwen3-MoE, Mixtral, DeepSeek-V3, gpt-oss; configs in code, see _hf_blocks.py),
dtype (float32, bfloat16) and token count, the block's experts module runs under transformers'
backends ('eager', 'grouped_mm', 'batched_mm' where its gathered weights fit in memory) and
under tutel ('tutel': the registered experts implementation), all on the same routing, which
the block's own router computes once.  'moe_layer' is tutel's moe_layer holding the same
weights (llama_ffn experts, dropless: capacity_factor 0, megablocks_size 1); it runs its own
router (a softmax top-k like the family's), so its time includes routing.  So for forward cases up
to BLOCK_MAX_TOKENS tokens, where routing is a visible part of a call, a second interleaved pair of
candidates compares it with the transformers block's own router followed by the experts under the
case's best backend in one call ('block'): 'best_block/moe_layer'.  (DeepSeek-V3's router, grouped
and biased, does more than the layer's; its shared experts run in neither.)

Limits measured in the same run, as two more candidates interleaved with the others so that they
see the same load (see _limits.py): compute = the FLOPs of the routed (token, expert) pairs at
the GEMM rate of a large matmul in the same dtype; bandwidth = the bytes of the distinct
experts' weights touched at the read bandwidth of a buffer 8x the last-level cache.  limit = the
larger.  Every timed call starts from the same cache state (_limits.cache_reset: a read of twice the
last-level cache, untimed), the cold weights of a decoding step, whatever candidate ran before.

    python benchmarks/transformers_moe.py          # writes benchmarks/results/transformers_moe.json
    python benchmarks/transformers_moe.py --smoke
    python benchmarks/transformers_moe.py --device cuda --full-size --dtypes bfloat16
                                                   # the published layer shapes on a GPU (transformers_moe_cuda.json)

On a CUDA device every timed call ends with a synchronisation, so a time is what the caller waits
for, kernel launches included (no CUDA graphs, as transformers runs these blocks by default).  Each
case there also records, per candidate (transformers' backends, 'tutel', 'moe_layer'; see
cuda_timing.py; --no-cuda-extras leaves them out, and a CPU run never pays for them):

    <name>_kernels, <name>_copies   kernels launched by one call after warm-up (torch.profiler's events
                                    on the CUDA device); memcpy and memset are not kernels, but copies
    <name>_graph_ms                 per call replayed from a captured CUDA graph (side-stream warm-up,
                                    static inputs, replays timed with CUDA events in interleaved rounds
                                    as the eager times are); None when the capture failed, and then
    <name>_graph_error              the capture error's first line
    best_transformers_graph, best_transformers_graph/tutel_graph, best_transformers_graph/moe_layer_graph,
    tutel_graph/limit, moe_layer_graph/limit
    tutel_sync_free, moe_layer_sync_free (+ <name>_sync_error)
                                    a training step (forward + backward) and a decoding step (no-grad
                                    forward) ran under torch.cuda.set_sync_debug_mode("error") without
                                    synchronising the host
    moe_layer_graph_equal, moe_layer_graph_bitwise, moe_layer_graph_vs_eager
                                    the no-grad forward replayed from a graph against the eager call:
                                    equal bit for bit, or within one rounding unit of the dtype
"""
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence

import torch

from _common import format_table, interleaved_medians, load_average, parse_args, write_result
from _hf_blocks import (FAMILIES, FULL_SIZES, build_block, case_inputs, experts_call, experts_flops_per_choice,
                        experts_weight_bytes, moe_layer_like, tutel_backend_name)
from _limits import LimitProbes, cache_reset, measure_limits, synchronized
from cuda_timing import (first_line, graph_replay_fields, interleaved_event_medians, kernels_per_call, outputs_match,
                         sync_free, try_capture)

TRANSFORMERS_BACKENDS = ("eager", "grouped_mm", "batched_mm")
FORWARD_TOKENS = (1, 16, 128, 2048, 8192)
TRAIN_TOKENS = (2048,)
SMOKE_FORWARD_TOKENS, SMOKE_TRAIN_TOKENS = (5,), (7,)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
BATCHED_MM_MAX_BYTES = 2 << 30  # batched_mm gathers one weight copy per (token, expert) pair
SECONDS_PER_CASE = 6.0  # the repetitions of a case are cut to about this much time
BLOCK_MAX_TOKENS = 128  # forward cases that also time the block (router + experts) against moe_layer


def _layer_call(layer, x, train: bool, grad) -> Callable[[], None]:
    def run():
        if train:
            for p in layer.parameters():
                p.grad = None
            x.grad = None
            y = layer(x, capacity_factor=0.0, megablocks_size=1)
            y.backward(grad)
        else:
            with torch.no_grad():
                layer(x, capacity_factor=0.0, megablocks_size=1)
    return run


def _layer_forward(layer, x) -> Callable[[], torch.Tensor]:
    """moe_layer's no-grad forward (dropless), returning its output: the call whose graph replay is
    compared with the eager one."""
    def run():
        with torch.no_grad():
            return layer(x, capacity_factor=0.0, megablocks_size=1)
    return run


def _block_call(block, backend: str, x) -> Callable[[], None]:
    """The transformers block's router and its experts under `backend`, without autograd, in one call."""
    def run():
        with torch.no_grad():
            indices, weights = block.router(x)
            block.config._experts_implementation = backend
            block.experts(x, indices, weights)
    return run


def _reps_for(candidates: Dict[str, Callable[[], None]], max_reps: int, min_reps: int = 1,
              seconds: float = SECONDS_PER_CASE) -> int:
    """Repetitions so that one case takes about `seconds` (each candidate timed once), at
    least `min_reps` (a median of one or two samples moves with every hiccup of a shared machine)."""
    start = time.perf_counter()
    for fn in candidates.values():
        fn()
    once = time.perf_counter() - start
    return max(1, min_reps, min(max_reps, int(seconds / max(once, 1e-6))))


def _relative_error_to_eager(block, ours: str, x, indices, weights) -> float:
    """||tutel - eager|| / ||eager|| of the experts' outputs in the block's dtype: a check that the
    timed implementation computes the same thing (the tests compare against float64)."""
    with torch.no_grad():
        block.config._experts_implementation = "eager"
        reference = block.experts(x, indices, weights).double()
        block.config._experts_implementation = ours
        ours_out = block.experts(x, indices, weights).double()
    return float((ours_out - reference).norm() / reference.norm().clamp_min(1e-30))


def measure_case(block, layer, ours: str, dtype_name: str, tokens: int, train: bool, smoke: bool,
                 max_reps: int, min_reps: int = 1, seconds: float = SECONDS_PER_CASE,
                 cuda_extras: bool = True) -> Dict[str, object]:
    """One case's row: every candidate's median time (interleaved rounds), the limits measured among
    them, the ratios, and on a CUDA device (unless `cuda_extras` is False) cuda_case_fields."""
    dtype = DTYPES[dtype_name]
    device = block.experts.down_proj.device
    x, indices, weights, grad = case_inputs(block, tokens, train)
    k = indices.shape[1]
    up = block.experts.gate_up_proj
    gathered = tokens * k * sum(p[0].numel() * p.element_size() for p in block.experts.parameters())
    backends = [b for b in TRANSFORMERS_BACKENDS if b != "batched_mm" or gathered * (3 if train else 1)
                <= BATCHED_MM_MAX_BYTES]
    calls = {b: experts_call(block, b, x, indices, weights, train, grad) for b in backends}
    calls["tutel"] = experts_call(block, ours, x, indices, weights, train, grad)
    if layer is not None:
        calls["moe_layer"] = _layer_call(layer, x, train, grad)
    candidates = {name: synchronized(fn, device) for name, fn in calls.items()}
    probes = LimitProbes(dtype, smoke, device)
    candidates.update(probes.candidates())
    reps = max_reps if max_reps <= 1 else _reps_for(candidates, max_reps, min(min_reps, max_reps), seconds)
    reset = cache_reset(smoke, device)  # its buffer is twice the last-level cache: made once per case
    times = interleaved_medians(candidates, reps, warmup=1 if reps > 1 else 0, before_each=reset)
    rates = probes.rates(times)  # the machine's rates during this case, under the same load
    error = _relative_error_to_eager(block, ours, x, indices, weights)
    flops = tokens * k * experts_flops_per_choice(block.experts) * (3 if train else 1)
    active = int(torch.unique(indices).numel())
    weight_bytes = active * experts_weight_bytes(block.experts)["per_expert"]
    compute_ms = flops / rates["gemm_flops"] * 1e3
    bandwidth_ms = weight_bytes / rates["read_bytes"] * 1e3
    row: Dict[str, object] = dict(family=block.name, dtype=dtype_name, pass_="fwd+bwd" if train else "fwd", T=tokens,
                                  k=k, E=up.shape[0], active_experts=active, reps=reps,
                                  compute_limit_ms=compute_ms, bandwidth_limit_ms=bandwidth_ms,
                                  limit_ms=max(compute_ms, bandwidth_ms), gemm_gflops=rates["gemm_flops"] / 1e9,
                                  read_gbps=rates["read_bytes"] / 1e9, load_before=load_average())
    for name, seconds in times.items():
        if not name.endswith("_probe"):
            row[f"{name}_ms"] = seconds * 1e3
    best = min(backends, key=lambda b: times[b])
    row["best_transformers"] = best
    row["best_transformers/tutel"] = times[best] / times["tutel"]
    row["tutel/limit"] = times["tutel"] * 1e3 / row["limit_ms"]
    if layer is not None:
        row["best_transformers/moe_layer"] = times[best] / times["moe_layer"]
        row["moe_layer/limit"] = times["moe_layer"] * 1e3 / row["limit_ms"]
        if not train and tokens <= BLOCK_MAX_TOKENS:
            pair = {"block": synchronized(_block_call(block, best, x), device), "moe_layer": candidates["moe_layer"]}
            pair_times = interleaved_medians(pair, reps, warmup=1 if reps > 1 else 0, before_each=reset)
            row["block_ms"] = pair_times["block"] * 1e3
            row["best_block/moe_layer"] = pair_times["block"] / pair_times["moe_layer"]
    row["tutel_vs_eager"] = error
    if device.type == "cuda" and cuda_extras:
        row.update(cuda_case_fields(block, layer, ours, calls, backends, (x, indices, weights, grad), reps,
                                    row["limit_ms"]))
    row["foreign_cpus"] = times.foreign_cpus
    row["pass"] = row.pop("pass_")
    return row


def kernel_fields(calls: Dict[str, Callable[[], object]],
                  count: Optional[Callable[[Callable[[], object]], Dict[str, float]]] = None) -> Dict[str, object]:
    """<name>_kernels and <name>_copies (memcpy + memset) per call of every candidate, counted by
    `count` (default cuda_timing.kernels_per_call); where counting fails, <name>_kernels is None and
    <name>_kernels_error holds the error's first line."""
    count = count or kernels_per_call
    fields: Dict[str, object] = {}
    for name, fn in calls.items():
        try:
            counts = count(fn)
        except Exception as error:  # noqa: BLE001 -- a profiler failure costs one number, not the run
            fields[f"{name}_kernels"] = None
            fields[f"{name}_kernels_error"] = first_line(error)
            continue
        fields[f"{name}_kernels"] = counts["kernels"]
        fields[f"{name}_copies"] = counts["memcpy"] + counts["memset"]
    return fields


def graph_ratios(fields: Dict[str, object], backends: Sequence[str], limit_ms: float) -> Dict[str, object]:
    """From the <name>_graph_ms in `fields`: the fastest of transformers' `backends` under graph
    replay and its ratios to tutel's and moe_layer's replays, and theirs to the case's limit.
    A ratio whose operand did not capture is None (so is the best backend when none captured)."""
    def ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
        return a / b if a is not None and b else None

    captured = [b for b in backends if fields.get(f"{b}_graph_ms") is not None]
    best = min(captured, key=lambda b: fields[f"{b}_graph_ms"]) if captured else None
    best_ms = fields[f"{best}_graph_ms"] if best is not None else None
    out: Dict[str, object] = {"best_transformers_graph": best}
    for ours in ("tutel", "moe_layer"):
        if f"{ours}_graph_ms" not in fields:
            continue
        ours_ms = fields[f"{ours}_graph_ms"]
        out[f"best_transformers_graph/{ours}_graph"] = ratio(best_ms, ours_ms)
        out[f"{ours}_graph/limit"] = ratio(ours_ms, limit_ms)
    return out


def graph_fields(calls: Dict[str, Callable[[], object]], backends: Sequence[str], reps: int,
                 limit_ms: float) -> Dict[str, object]:
    """cuda_timing.graph_replay_fields of every candidate (each captured into its own CUDA graph, the
    replays timed in `reps` interleaved rounds; None and <name>_graph_error where a capture failed),
    plus graph_ratios."""
    fields = graph_replay_fields(calls, reps, capture=try_capture, medians=interleaved_event_medians)
    fields.update(graph_ratios(fields, backends, limit_ms))
    return fields


def sync_fields(steps: Dict[str, Dict[str, Callable[[], object]]]) -> Dict[str, object]:
    """<name>_sync_free for each candidate's {step name: call} (cuda_timing.sync_free), and
    <name>_sync_error (the first synchronising step and its error) where it is False."""
    fields: Dict[str, object] = {}
    for name, named_steps in steps.items():
        free, error = sync_free(named_steps)
        torch.cuda.synchronize()  # a step stopped by the check may have left work queued
        fields[f"{name}_sync_free"] = free
        if error is not None:
            fields[f"{name}_sync_error"] = error
    return fields


def training_and_decoding_steps(block, layer, ours: str, x, indices, weights, grad) -> Dict[str, Dict[str, Callable]]:
    """For tutel's experts and moe_layer (dropless): a training step (forward and backward, on a copy
    of `x` that requires grad) and a decoding step (no-grad forward), whatever the case's own pass."""
    x_train, x_decode = x.detach().clone().requires_grad_(True), x.detach()
    steps = {"tutel": {"fwd+bwd": experts_call(block, ours, x_train, indices, weights, True, grad),
                       "fwd": experts_call(block, ours, x_decode, indices, weights, False, grad)}}
    if layer is not None:
        steps["moe_layer"] = {"fwd+bwd": _layer_call(layer, x_train, True, grad),
                              "fwd": _layer_call(layer, x_decode, False, grad)}
    return steps


def graph_equality_fields(forward: Callable[[], torch.Tensor], prefix: str = "moe_layer") -> Dict[str, object]:
    """<prefix>_graph_equal / _bitwise / _vs_eager: `forward`'s output replayed from a CUDA graph
    against an eager call's (cuda_timing.outputs_match).  The graph's output is poisoned (NaN) before
    the replay, so an element the replay leaves unwritten cannot pass.  None where the capture failed
    (graph_fields records why)."""
    eager = forward().clone()
    captured, _ = try_capture(forward)
    if captured is None:
        return {f"{prefix}_graph_equal": None}
    captured.output.fill_(float("nan"))
    captured.graph.replay()
    torch.cuda.synchronize()
    match = outputs_match(eager, captured.output)
    del captured
    torch.cuda.empty_cache()
    return {f"{prefix}_graph_equal": match["equal"], f"{prefix}_graph_bitwise": match["bitwise"],
            f"{prefix}_graph_vs_eager": match["relative"]}


def cuda_case_fields(block, layer, ours: str, calls: Dict[str, Callable[[], object]], backends: Sequence[str],
                     inputs: tuple, reps: int, limit_ms: float) -> Dict[str, object]:
    """The CUDA-only fields of a case (see the module's docstring), in an order that keeps each
    measurement clear of the others' leftovers: kernel counts, sync checks, graph replays (every
    capture freed after), moe_layer's graph against its eager output."""
    x, indices, weights, grad = inputs
    fields = kernel_fields(calls)
    fields.update(sync_fields(training_and_decoding_steps(block, layer, ours, x, indices, weights, grad)))
    fields.update(graph_fields(calls, backends, reps, limit_ms))
    if layer is not None:
        fields.update(graph_equality_fields(_layer_forward(layer, x.detach())))
    return fields


COLUMNS = ["family", "dtype", "pass", "T", "active_experts", "eager_ms", "grouped_mm_ms", "batched_mm_ms", "tutel_ms",
           "moe_layer_ms", "limit_ms", "tutel/limit", "best_transformers", "best_transformers/tutel",
           "moe_layer/limit", "best_transformers/moe_layer", "block_ms", "best_block/moe_layer", "tutel_vs_eager",
           "gemm_gflops", "read_gbps", "foreign_cpus"]
# The CUDA-only fields (cuda_case_fields) shown in a table of their own: the main one is wide already.
CUDA_COLUMNS = (["family", "dtype", "pass", "T"]
                + [f"{name}_kernels" for name in TRANSFORMERS_BACKENDS + ("tutel", "moe_layer")]
                + [f"{name}_graph_ms" for name in TRANSFORMERS_BACKENDS + ("tutel", "moe_layer")]
                + ["limit_ms", "best_transformers_graph", "best_transformers_graph/tutel_graph", "tutel_graph/limit",
                   "best_transformers_graph/moe_layer_graph", "tutel_sync_free", "moe_layer_sync_free",
                   "moe_layer_graph_equal"])
KERNEL_COUNT_NOTE = ("<name>_kernels: kernel events on the CUDA device in torch.profiler for one call after "
                     "warm-up, memcpy and memset excluded (those are <name>_copies)")


def lscpu_model() -> Optional[str]:
    """The CPU's model name as lscpu prints it (None without lscpu)."""
    import subprocess
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("Model name")), None)


def cpu_flags() -> str:
    """The CPU features that decide the GEMM kernels' speed, and whether oneDNN has native 16-bit dot products."""
    from tutel.ops.precision import cpu_has_native
    try:
        present = set(open("/proc/cpuinfo").read().split("flags", 1)[1].split("\n", 1)[0].split())
    except (OSError, IndexError):
        present = set()
    wanted = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16", "avx512_fp16")
    native = "native bf16 dot products" if cpu_has_native(torch.bfloat16) else "no native bf16 dot products"
    return " ".join(flag for flag in wanted if flag in present) + f"; oneDNN: {native}"


def _own_options(argv: Optional[Sequence[str]]):
    """This script's options beyond the common ones: --families, --dtypes, --tokens (subsets)."""
    import argparse
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--dtypes", default=",".join(DTYPES))
    parser.add_argument("--tokens", default=None, help="forward token counts, e.g. 1,16,2048")
    parser.add_argument("--train-tokens", default=None)
    parser.add_argument("--max-tokens-16bit", type=int, default=None,
                        help="skip bfloat16 cases above this many tokens (on a loaded machine, or a CPU whose "
                             "16-bit GEMMs are slow, they take minutes each)")
    parser.add_argument("--result-name", default="transformers_moe",
                        help="JSON name under --out (benchmarks/report.py also shows 'transformers_moe_16bit_large', "
                             "a separate run of the 16-bit cases the main run skips)")
    parser.add_argument("--no-train-16bit", action="store_true",
                        help="skip the bfloat16 forward+backward cases (transformers' eager backend takes minutes "
                             "per repetition there on CPUs without native 16-bit dot products)")
    parser.add_argument("--device", default="cpu", help="where the blocks run: cpu (default) or cuda")
    parser.add_argument("--full-size", action="store_true",
                        help="the published models' layer shapes (_hf_blocks.FULL_SIZES) instead of the scaled ones")
    parser.add_argument("--seconds-per-case", type=float, default=SECONDS_PER_CASE,
                        help="repetitions of a case are cut to about this much time")
    parser.add_argument("--no-cuda-extras", action="store_true",
                        help="on a CUDA device, only the synchronised times: no kernel counts, CUDA graph "
                             "replays or synchronisation checks (see the module's docstring)")
    parser.add_argument("--min-reps", type=int, default=1,
                        help="repetitions of every case at least (cases are otherwise cut to about "
                             f"{SECONDS_PER_CASE:.0f} s, down to one repetition)")
    own, rest = parser.parse_known_args(list(sys.argv[1:] if argv is None else argv))
    return own, rest


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, object]:
    given = list(sys.argv[1:] if argv is None else argv)
    own, argv = _own_options(given)
    args = parse_args(__doc__.splitlines()[0], argv, default_reps=10)
    ours = tutel_backend_name()
    dtypes = {name: DTYPES[name] for name in own.dtypes.split(",")}
    on_gpu = torch.device(own.device).type == "cuda"
    if on_gpu and own.result_name == "transformers_moe":
        own.result_name = "transformers_moe_cuda"
    limits = measure_limits(list(dtypes.values()), args.smoke, own.device)
    print("limits:", {key: round(value, 1) for key, value in limits.items()}, "tutel backend:", ours, flush=True)
    rows: List[Dict[str, object]] = []
    forward_tokens = SMOKE_FORWARD_TOKENS if args.smoke else FORWARD_TOKENS
    train_tokens = SMOKE_TRAIN_TOKENS if args.smoke else TRAIN_TOKENS
    if own.tokens is not None:
        forward_tokens = [int(t) for t in own.tokens.split(",") if t]
    if own.train_tokens is not None:
        train_tokens = [int(t) for t in own.train_tokens.split(",") if t]
    families = own.families.split(",")
    result = {"rows": rows, "columns": COLUMNS, "limits": limits, "tutel_backend": ours,
              "lscpu_model": lscpu_model(), "cpu_flags": cpu_flags(),
              "families": {name: dict(FAMILIES[name][1], **(FULL_SIZES[name] if own.full_size else {}))
                           for name in families}, "reps": args.reps, "device": own.device,
              "device_name": torch.cuda.get_device_name(own.device) if on_gpu else None,
              "command": " ".join(["python benchmarks/transformers_moe.py"] + given)}
    cuda_extras = on_gpu and not own.no_cuda_extras
    if cuda_extras:
        result.update(cuda_columns=CUDA_COLUMNS, kernel_count_note=KERNEL_COUNT_NOTE)
    for dtype_name, dtype in dtypes.items():
        for family in families:
            block = build_block(family, dtype, args.smoke, device=own.device, full_size=own.full_size)
            layer = moe_layer_like(block)
            cases = [(t, False) for t in forward_tokens] + [(t, True) for t in train_tokens]
            if dtype != torch.float32 and own.max_tokens_16bit is not None:
                cases = [(t, train) for t, train in cases if t <= own.max_tokens_16bit]
            if dtype != torch.float32 and own.no_train_16bit:
                cases = [(t, train) for t, train in cases if not train]
            for tokens, train in cases:
                row = measure_case(block, layer, ours, dtype_name, tokens, train, args.smoke, args.reps,
                                   own.min_reps, own.seconds_per_case, cuda_extras)
                rows.append(row)
                print(format_table([row], COLUMNS), flush=True)
                if cuda_extras:
                    print(format_table([row], CUDA_COLUMNS), flush=True)
            del block, layer
            if on_gpu:
                torch.cuda.empty_cache()
            write_result(args.out, own.result_name, dict(result, partial=True), args.smoke)  # kept if stopped later
    result["limits_after"] = measure_limits(list(dtypes.values()), args.smoke, own.device)
    write_result(args.out, own.result_name, result, args.smoke)
    print(format_table(rows, COLUMNS))
    if cuda_extras:
        print(format_table(rows, CUDA_COLUMNS))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
