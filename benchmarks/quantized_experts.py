"""Experts with quantized weights on the CPU, through tutel's public call: MXFP4, NVFP4 and
block-scaled FP8 (``tutel.experts.routed_quantized_experts``) against the same layer in bfloat16
through tutel (``tutel.experts.routed_experts``) and through transformers' own experts (its
``eager`` and ``grouped_mm`` implementations), at the layer shapes of gpt-oss-20b (H = I = 2880,
E = 32, k = 4, clamped interleaved SwiGLU with biases) and Qwen3-30B-A3B (H = 2048, I = 768,
E = 128, k = 8, SwiGLU), for T = 1, 16 and 2048 tokens of bfloat16.

At decoding sizes a step must at least read the weights of the experts its tokens chose, once.
limit_ms is that floor for each candidate: the bytes of the distinct chosen experts' tensors in its
format (codes, scales, biases) over the read bandwidth measured in the same run (a sum over a
1 GiB buffer, timed interleaved with the candidates).  Before every timed call a sum over a buffer
twice the last-level cache evicts the weights (_limits.cache_reset), as the other layers of a model
would.  Per row: each candidate's median ms, its ms / limit_ms, and bf16_ms / its ms (bf16 being
tutel's bfloat16 call); the targets of the quantized path are judged in ``targets``:

* T = 1: MXFP4 at least 3.0x faster than bfloat16 and within 1.3x of its own read limit; FP8 at
  least 1.7x faster than bfloat16;
* T = 2048: every format within 1.15x of the bfloat16 time.

A read's speed depends on its length (the prefetchers' ramp, the call's fixed cost, the pages it
walks), and a decoding step reads tens of MB, not a GiB.  Up to SAME_SIZE_READ_TOKENS tokens the run
therefore also times, among the candidates and from the same cold caches, a sum over as many bytes
as each candidate's chosen experts hold (one PyTorch call, as each candidate is): <name>_read_ms,
<name>/read = <name>_ms / <name>_read_ms, and bf16/<name>_read = bf16_ms / <name>_read_ms, the most
a call that reads those bytes once, and does nothing else, could be faster than tutel's bfloat16
call on this machine.  At the same sizes each tutel call is also timed on one thread
(torch.set_num_threads(1) around the call): <name>_one_thread_ms, and <name>_threads = its ratio to
<name>_ms, the speed the machine's other threads add.  A call that waits on memory gains little from
them; one held back by its instructions (decoding the codes) gains nearly their number.

The quantized stacks hold random codes and scales of moderate size: the time does not depend on
the values (tests/python hold the values to float64 references).

    python benchmarks/quantized_experts.py              # writes benchmarks/results/quantized_experts.json
    python benchmarks/quantized_experts.py --smoke      # tiny shapes, one repetition
    python benchmarks/quantized_experts.py --device cuda    # on a GPU: quantized_experts_cuda.json

On a CUDA device (``--device cuda``; tutel built with its CUDA operators) the same layers and token
counts run on the GPU, each layer in its checkpoint's format first (gpt-oss-20b: MXFP4; Qwen3-30B-A3B:
block FP8) and in the two others too.  Per candidate and case:

    <name>_ms            eager: CUDA events around each call (launches included), started on an idle
                         device whose L2 holds none of the call's weights (_limits.device_cache_reset),
                         median over interleaved rounds after a warm-up round
    <name>_graph_ms      the call captured into a CUDA graph and replayed, timed the same way; None when
                         the capture failed, and then <name>_graph_error (the error's first line)
    <name>_kernels       kernels launched by one call after warm-up (torch.profiler), <name>_copies the
                         memcpy and memset
    <name>_limit_ms      the read limit as above (the read bandwidth: a 1 GiB sum, or 8x the L2, timed
                         among the candidates), with <name>/limit and <name>_graph/limit

The candidates: tutel's quantized call in each format (`mxfp4`, `nvfp4`, `fp8_block`; weight-only),
its bfloat16 call on the same layer (`bf16`, ``routed_experts``) and, for Qwen3's block-FP8 layer,
transformers' ``FP8Experts`` module over the same FP8 tensors (128 x 128 blocks, activation_scheme
"dynamic"), run under each of its experts implementations (`hf_fp8_<name>`) and under tutel's
(`hf_fp8_tutel`: W8A8 as transformers' kernels compute; `hf_fp8_tutel_weight_only`).  transformers'
own FP8 kernels come from the Hugging Face kernels hub (``kernels``: finegrained-fp8 Triton kernels,
DeepGEMM): an implementation that does not run here (no ``kernels`` package, no cached kernel, an
unsupported GPU) is skipped, its error's first line kept in the row's `skipped`.  gpt-oss' layer has
biases, which FP8Experts does not take (transformers asserts has_bias=False): no FP8Experts there.

The CUDA targets (``targets`` of quantized_experts_cuda.json; a target that could not be measured
has ``met`` None and says why):

* T = 1: the layer's own format replayed from a CUDA graph within 1.5x of its read limit;
* every T: transformers' fastest FP8 experts implementation (eager) at least 1.2x slower than
  tutel's under the same module and activations (`best_hf_fp8/tutel`), Qwen3's layer;
* T = 2048: the layer's own format (eager) within 1.1x of tutel's bfloat16 time.
"""
import argparse
import copy
import functools
import sys
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch

from _common import format_table, interleaved_medians, parse_args, present_columns, write_result
from _hf_blocks import build_block
from _limits import LimitProbes, cache_reset, device_cache_reset
from cuda_timing import first_line, graph_replay_fields, interleaved_event_medians
from transformers_moe import kernel_fields

from tutel.experts import routed_experts, routed_quantized_experts
from tutel.ops.gated_units import SWIGLU, GatedUnit
from tutel.quant import Fp8BlockWeights, Mxfp4Weights, Nvfp4Weights, QuantizedWeights

FORMATS = ("mxfp4", "nvfp4", "fp8_block")
FP8_BLOCK = (128, 128)
TRANSFORMERS = ("eager", "grouped_mm")
TOKEN_COUNTS = (1, 16, 2048)
SAME_SIZE_READ_TOKENS = 16  # the decoding sizes, whose reads are short
SMOKE_TOKEN_COUNTS = (1, 3, 40)
# (the fp4 formats take rows of whole 32-element blocks)
SMOKE_SIZES = dict(hidden_size=64, intermediate_size=32, moe_intermediate_size=32)
#: (tokens, format, the bound, what is bounded): the quantized path's targets.
TARGETS = [(1, "mxfp4", 3.0, "bf16/mxfp4 >="), (1, "mxfp4", 1.3, "mxfp4/limit <="),
           (1, "fp8_block", 1.7, "bf16/fp8_block >=")] + \
          [(2048, f, 1.15, f"{f}/bf16 <=") for f in FORMATS]
COLUMNS = ["model", "T", "experts_read", "bf16_ms", "bf16/limit"] + \
    [f"hf_{name}_ms" for name in TRANSFORMERS] + \
    [column for f in FORMATS for column in (f"{f}_ms", f"{f}/limit", f"bf16/{f}")] + \
    ["mxfp4/read", "bf16/mxfp4_read", "fp8_block/read", "bf16/fp8_block_read", "bf16_threads", "mxfp4_threads",
     "read_gbps", "foreign_cpus"]

#: The CUDA targets: (tokens, None = every T; the layer's own format fills {own}; bound; what).
CUDA_TARGETS = [(1, None, 1.5, "{own}_graph/limit <="), (None, None, 1.2, "best_hf_fp8/tutel >="),
                (2048, None, 1.1, "{own}/bf16 <=")]
#: transformers' FP8 experts implementations this benchmark does not try, and why.
FP8_BACKENDS_LEFT_OUT = {"deepgemm_megamoe": "takes FP4-packed weights (int8) and an expert-parallel process "
                                             "group on Blackwell (SM100); this layer is block FP8 on one device"}
#: What FP8Experts under tutel is compared with transformers' own implementations under.
FP8_TUTEL = "hf_fp8_tutel"
CUDA_REPS = 30  # interleaved rounds per case on a GPU (a third of them, at least 5, past 256 tokens)


class Layer(NamedTuple):
    model: str
    family: str  # benchmarks/_hf_blocks.py's family name
    unit: GatedUnit
    format: str  # the format its quantized checkpoints come in


LAYERS = [Layer("gpt-oss-20b", "gpt_oss", GatedUnit(1.702, 1.0, 7.0, interleaved=True), "mxfp4"),
          Layer("Qwen3-30B-A3B", "qwen3_moe", SWIGLU, "fp8_block")]


def random_stack(format: str, experts: int, rows: int, cols: int, device: str = "cpu") -> QuantizedWeights:
    """A stack of random codes and moderate scales in `format` (no NaN codes or scales), made on `device`."""
    if format == "fp8_block":
        codes = torch.randint(0, 0x70, (experts, rows, cols), dtype=torch.uint8, device=device)
        scales = torch.rand(experts, -(-rows // FP8_BLOCK[0]), -(-cols // FP8_BLOCK[1]), device=device) * 1e-3
        return Fp8BlockWeights(codes.view(torch.float8_e4m3fn), scales, block=FP8_BLOCK)
    codes = torch.randint(0, 256, (experts, rows, cols // 2), dtype=torch.uint8, device=device)
    if format == "mxfp4":
        return Mxfp4Weights(codes, torch.randint(118, 124, (experts, rows, cols // 32), dtype=torch.uint8,
                                                 device=device))
    scales = torch.randint(0x20, 0x40, (experts, rows, cols // 16), dtype=torch.uint8, device=device)
    return Nvfp4Weights(codes, scales.view(torch.float8_e4m3fn), torch.rand(experts, device=device) * 0.01)


def routing(tokens: int, experts: int, k: int, seed: int):
    """Each token's k distinct experts (uniform) and softmax weights."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(tokens)]) \
        if tokens else torch.zeros(0, k, dtype=torch.int64)
    return ids, torch.softmax(torch.randn(tokens, k, generator=gen), dim=-1)


def _stacks_bytes(stacks: Sequence[QuantizedWeights]) -> int:
    return sum(stack.packed_bytes() for stack in stacks)


class LayerWeights(NamedTuple):
    """One layer's weights: transformers' bfloat16 experts module and the same layer's quantized stacks."""
    experts: torch.nn.Module  # transformers' experts (bfloat16)
    config: object
    gate_up: torch.Tensor  # [E, 2I, H], or [E, H, 2I] where `transposed` (gpt-oss)
    down: torch.Tensor
    transposed: bool
    biases: List[Optional[torch.Tensor]]  # up and down biases in float32 (None without)
    bf16_biases: List[Optional[torch.Tensor]]
    stacks: Dict[str, Tuple[QuantizedWeights, QuantizedWeights]]  # format: (up, down)
    bytes_per_expert: Dict[str, int]  # "bf16" and each format: one expert's tensors, biases included
    num_experts: int
    hidden: int
    inter: int
    k: int


def layer_weights(layer: Layer, smoke: bool, device: str = "cpu") -> LayerWeights:
    """`layer` at its published shape (tiny under `smoke`) on `device`: transformers' block with random
    bfloat16 weights, and random stacks of the same shape in every format."""
    block = build_block(layer.family, torch.bfloat16, smoke, device=device, full_size=not smoke,
                        sizes=SMOKE_SIZES if smoke else None)
    experts, config = block.experts, block.config
    # transformers' experts: [E, 2I, H] / [E, H, I], or transposed ([E, H, 2I] / [E, I, H]) in gpt-oss
    transposed = bool(getattr(experts, "is_transposed", False))
    gate_up, down = experts.gate_up_proj.detach(), experts.down_proj.detach()
    num_experts = gate_up.shape[0]
    up_rows, hidden = (gate_up.shape[2], gate_up.shape[1]) if transposed else gate_up.shape[1:]
    up_bias = getattr(experts, "gate_up_proj_bias", None)
    down_bias = getattr(experts, "down_proj_bias", None)
    biases = [b.detach().float() if b is not None else None for b in (up_bias, down_bias)]
    bias_bytes = sum(b[0].numel() * 4 for b in biases if b is not None)
    stacks = {f: (random_stack(f, num_experts, up_rows, hidden, device),
                  random_stack(f, num_experts, hidden, up_rows // 2, device)) for f in FORMATS}
    bytes_per_expert = {"bf16": (gate_up[0].numel() + down[0].numel()) * 2 + bias_bytes // 2}
    bytes_per_expert.update({f: _stacks_bytes(pair) // num_experts + bias_bytes for f, pair in stacks.items()})
    bf16_biases = [b.to(torch.bfloat16) if b is not None else None for b in biases]
    return LayerWeights(experts, config, gate_up, down, transposed, biases, bf16_biases, stacks, bytes_per_expert,
                        num_experts, hidden, up_rows // 2, config.num_experts_per_tok)


def case_inputs(weights: LayerWeights, tokens: int, device: str = "cpu"):
    """(x, expert ids, routing weights) of `tokens` random bfloat16 tokens on `device` (routing seeded by `tokens`)."""
    x = torch.randn(tokens, weights.hidden).to(torch.bfloat16).to(device)
    ids, routing_weights = routing(tokens, weights.num_experts, weights.k, seed=tokens)
    return x, ids.to(device), routing_weights.to(torch.bfloat16).to(device)


def bf16_call(layer: Layer, w: LayerWeights, x, ids, routing_weights) -> Callable[[], torch.Tensor]:
    """tutel's bfloat16 call (routed_experts) on the layer."""
    return lambda: routed_experts(x, ids, routing_weights, w.gate_up, w.down, up_bias=w.bf16_biases[0],
                                  down_bias=w.bf16_biases[1], transposed=w.transposed, gate=layer.unit)


def quantized_call(layer: Layer, w: LayerWeights, format: str, x, ids, routing_weights) -> Callable[[], torch.Tensor]:
    """tutel's quantized call (routed_quantized_experts, weight-only) on the layer's stacks in `format`."""
    up, down = w.stacks[format]
    return lambda: routed_quantized_experts(x, ids, routing_weights, up, down, gate=layer.unit, up_bias=w.biases[0],
                                            down_bias=w.biases[1])


def on_one_thread(call: Callable[[], object]) -> Callable[[], object]:
    """`call` run with PyTorch's (and so tutel's) intra-op threads set to one."""
    def run():
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            call()
        finally:
            torch.set_num_threads(threads)
    return run


def time_layer(layer: Layer, token_counts: Sequence[int], reps: int, smoke: bool,
               read_buffer: torch.Tensor) -> List[Dict[str, object]]:
    w = layer_weights(layer, smoke)
    experts, config = w.experts, w.config
    reset = cache_reset(smoke)
    rows = []
    for tokens in token_counts:
        x, ids, weights = case_inputs(w, tokens)

        def transformers_call(implementation: str) -> Callable[[], object]:
            def run():
                config._experts_implementation = implementation
                experts(x, ids, weights)
            return run

        experts_read = int(ids.unique().numel())
        candidates = {"bf16": bf16_call(layer, w, x, ids, weights),
                      **{f"hf_{name}": transformers_call(name) for name in TRANSFORMERS},
                      **{f: quantized_call(layer, w, f, x, ids, weights) for f in FORMATS},
                      "read_probe": read_buffer.sum}
        same_size = ("bf16",) + FORMATS if tokens <= SAME_SIZE_READ_TOKENS else ()
        for name in same_size:  # float32 ones: a sum with no NaN or subnormal to slow it
            candidates[f"read_{name}"] = torch.ones(max(1, experts_read * w.bytes_per_expert[name] // 4)).sum
            candidates[f"{name}_one_thread"] = on_one_thread(candidates[name])
        runs = max(5, reps // 3) if tokens > 256 else reps  # prefill calls vary more from run to run
        with torch.inference_mode():
            times = interleaved_medians(candidates, runs, warmup=1, before_each=reset)
        del candidates
        read_bytes_per_s = read_buffer.numel() * read_buffer.element_size() / times["read_probe"]
        row = {"model": layer.model, "T": tokens, "k": w.k, "E": w.num_experts, "H": w.hidden, "I": w.inter,
               "experts_read": experts_read, "read_gbps": read_bytes_per_s / 1e9, "foreign_cpus": times.foreign_cpus}
        for name in TRANSFORMERS:
            row[f"hf_{name}_ms"] = times[f"hf_{name}"] * 1e3
        for name in ("bf16",) + FORMATS:
            limit_s = experts_read * w.bytes_per_expert[name] / read_bytes_per_s
            row[f"{name}_ms"] = times[name] * 1e3
            row[f"{name}/limit"] = times[name] / limit_s if limit_s else None
            if name != "bf16":
                row[f"bf16/{name}"] = times["bf16"] / times[name]
                row[f"{name}/bf16"] = times[name] / times["bf16"]
            if name in same_size:
                read_s = times[f"read_{name}"]
                row[f"{name}_read_ms"] = read_s * 1e3
                row[f"{name}/read"] = times[name] / read_s
                if name != "bf16":
                    row[f"bf16/{name}_read"] = times["bf16"] / read_s
                row[f"{name}_one_thread_ms"] = times[f"{name}_one_thread"] * 1e3
                row[f"{name}_threads"] = times[f"{name}_one_thread"] / times[name]
        rows.append(row)
    return rows


def judge(rows: Sequence[Dict[str, object]], smoke: bool,
          targets: Sequence[tuple] = TARGETS) -> List[Dict[str, object]]:
    """Each target on each layer: the measured value and whether it holds.

    A target names its tokens (None: every T measured) and the field it bounds; "{own}" in the field
    stands for the row's own format.  A row without the field is not judged (the target does not
    apply to it); a row whose field is None (a capture that failed, no implementation to compare
    with) gets met None and why (`<field's candidate>_graph_error`, or the row's `why/<field>`), and
    so does a case that failed as a whole (its row's `error`)."""
    verdicts = []
    for tokens, _, bound, what in targets:
        if smoke and tokens is not None:
            tokens = {2048: SMOKE_TOKEN_COUNTS[-1]}.get(tokens, tokens)
        for row in rows:
            text = what.format(own=row.get("format"))
            key = text.split()[0]
            if tokens is not None and row["T"] != tokens:
                continue
            if key not in row and not (row.get("error") and (not key.startswith("best_hf_fp8")
                                                             or row.get("fp8_experts"))):
                continue
            value = row.get(key)
            verdict = {"model": row["model"], "T": row["T"], "target": f"{text} {bound}", "value": value}
            if "error" in row:
                verdict.update(met=None, why=row["error"])
            elif value is None:
                field = key.split("/")[0]
                candidate = field[:-len("_graph")] if field.endswith("_graph") else field
                verdict["met"] = None
                verdict["why"] = (row.get(f"why/{key}") or row.get(f"{field}_error")
                                  or (row.get("skipped") or {}).get(candidate) or "not measured")
            else:
                verdict["met"] = bool(value >= bound if text.endswith(">=") else value <= bound)
            verdicts.append(verdict)
    return verdicts


def verdict_line(verdict: Dict[str, object]) -> str:
    """One target's verdict as a line of text."""
    if verdict["met"] is None:
        return f"{verdict['model']} T={verdict['T']}: {verdict['target']}: not measured ({verdict.get('why')})"
    return (f"{verdict['model']} T={verdict['T']}: {verdict['target']}: {verdict['value']:.2f} "
            f"({'met' if verdict['met'] else 'NOT met'})")


# ---------------------------------------------------------------------------------------- on a GPU

def cuda_unavailable() -> Optional[str]:
    """Why this process cannot run the CUDA benchmark (None when it can)."""
    if not torch.cuda.is_available():
        return (f"quantized_experts.py --device cuda needs a CUDA device: torch.cuda.is_available() is False "
                f"(torch {torch.__version__}, CUDA build: {torch.version.cuda or 'none'}); run it on a GPU machine "
                f"(bash benchmarks/run_on_gpu.sh) or without --device cuda for the CPU benchmark")
    import tutel.cuda
    if not tutel.cuda.is_built():
        return ("quantized_experts.py --device cuda needs tutel built with its CUDA operators: "
                "TUTEL_WITH_CUDA=1 python setup.py build_ext --inplace")
    return None


def fp8_experts_backends() -> Dict[str, Optional[str]]:
    """transformers' experts implementations for its FP8 experts (``FP8Experts``): {name: None} for those
    this benchmark tries ('eager', the module's own forward, and those in ALL_FP8_EXPERTS_FUNCTIONS but
    tutel's), {name: why} for those it leaves out (FP8_BACKENDS_LEFT_OUT).  {} where the installed
    transformers has no FP8 experts."""
    try:
        from transformers.integrations.finegrained_fp8 import ALL_FP8_EXPERTS_FUNCTIONS
    except ImportError:
        return {}
    from _hf_blocks import tutel_backend_name
    ours = tutel_backend_name()
    names = ["eager"] + [name for name in ALL_FP8_EXPERTS_FUNCTIONS.keys() if name not in ("eager", ours)]
    return {name: FP8_BACKENDS_LEFT_OUT.get(name) for name in names}


def fp8_experts_modules(config, up: Fp8BlockWeights, down: Fp8BlockWeights) -> Dict[str, torch.nn.Module]:
    """transformers' FP8Experts over the codes of `up` and `down` (shared, not copied), declared as its
    quantizer declares them: {"dynamic": activation_scheme "dynamic" (W8A8), "weight_only": the same
    tensors with tutel told to leave the activations unquantized}.  The fused [gate; up] scales take
    transformers' own shape (at least two rows of blocks); `up`'s are shared where theirs has it."""
    from transformers.integrations.finegrained_fp8 import ALL_FP8_EXPERTS_FUNCTIONS, FP8Experts
    from transformers.integrations.moe import use_experts_implementation
    from tutel.integrations.transformers.fp8_experts import FP8_ACTIVATIONS
    experts_class = use_experts_implementation(experts_class=type("BenchmarkFP8Experts", (FP8Experts,), {}),
                                               experts_interface=ALL_FP8_EXPERTS_FUNCTIONS)
    num_experts, up_rows, hidden = up.weight.shape
    up_scales = up.scale_inv
    scale_rows = max(-(-up_rows // FP8_BLOCK[0]), 2)
    if up_scales.shape[1] != scale_rows:
        up_scales = torch.rand(num_experts, scale_rows, up_scales.shape[2], device=up_scales.device) * 1e-3
    modules = {}
    for activations in ("dynamic", "weight_only"):
        with torch.device("meta"):
            module = experts_class(copy.deepcopy(config), block_size=FP8_BLOCK, activation_scheme="dynamic")
        for name, codes, scales in (("gate_up_proj", up.weight, up_scales), ("down_proj", down.weight, down.scale_inv)):
            setattr(module, name, torch.nn.Parameter(codes, requires_grad=False))
            setattr(module, f"{name}_scale_inv", torch.nn.Parameter(scales, requires_grad=False))
        if activations == "weight_only":
            setattr(module, FP8_ACTIVATIONS, "weight_only")
        modules[activations] = module
    return modules


def fp8_module_call(module: torch.nn.Module, implementation: str, x, ids,
                    routing_weights) -> Callable[[], torch.Tensor]:
    """One no-grad call of an FP8Experts `module` under experts implementation `implementation`."""
    def run():
        module.config._experts_implementation = implementation
        with torch.no_grad():
            return module(x, ids, routing_weights)
    return run


def _settle(device: torch.device) -> None:
    """Waits for `device` after a failed call, ignoring an error there (it is recorded already)."""
    if device.type == "cuda":
        try:
            torch.cuda.synchronize(device)
        except Exception:  # noqa: BLE001
            pass


def runnable(calls: Dict[str, Callable[[], object]], names: Sequence[str], device: torch.device) -> Dict[str, str]:
    """Runs each of `names` once; those that raise are taken out of `calls`: {name: the error's first line}.
    (transformers' FP8 kernels come from the kernels hub: a machine without it cannot run them.)"""
    failed = {}
    for name in names:
        try:
            calls[name]()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        except Exception as error:  # noqa: BLE001 -- a backend that does not run is a result, not a crash
            _settle(device)
            failed[name] = first_line(error)
            del calls[name]
    return failed


def cuda_case_calls(layer: Layer, w: LayerWeights, fp8_modules: Optional[Dict[str, torch.nn.Module]],
                    backends: Dict[str, Optional[str]], x, ids, routing_weights) -> Tuple[Dict[str, Callable], Dict]:
    """The candidates of one case ({name: no-grad call returning the output}) and {hf_fp8_<name>: why}
    for transformers' implementations left out."""
    def no_grad(fn):
        def run():
            with torch.no_grad():
                return fn()
        return run

    calls = {"bf16": no_grad(bf16_call(layer, w, x, ids, routing_weights)),
             **{f: no_grad(quantized_call(layer, w, f, x, ids, routing_weights)) for f in FORMATS}}
    skipped = {}
    if fp8_modules is not None:
        from _hf_blocks import tutel_backend_name
        ours = tutel_backend_name()
        calls[FP8_TUTEL] = fp8_module_call(fp8_modules["dynamic"], ours, x, ids, routing_weights)
        calls[f"{FP8_TUTEL}_weight_only"] = fp8_module_call(fp8_modules["weight_only"], ours, x, ids, routing_weights)
        for name, why in backends.items():
            if why is None:
                calls[f"hf_fp8_{name}"] = fp8_module_call(fp8_modules["dynamic"], name, x, ids, routing_weights)
            else:
                skipped[f"hf_fp8_{name}"] = why
    return calls, skipped


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return a / b if a is not None and b else None


def measure_cuda_case(layer: Layer, w: LayerWeights, tokens: int, reps: int, probes: LimitProbes,
                      flush: Optional[Callable[[], object]], fp8_modules: Optional[Dict[str, torch.nn.Module]],
                      backends: Dict[str, Optional[str]], device: str = "cuda",
                      count: Optional[Callable] = None) -> Dict[str, object]:
    """One case's row on the GPU (see the module's docstring): eager times, kernels per call, graph
    replays, read limits, the ratios the targets bound.  `count` replaces the profiler's kernel count
    (cuda_timing.kernels_per_call) where given."""
    device = torch.device(device)
    x, ids, routing_weights = case_inputs(w, tokens, str(device))
    calls, skipped = cuda_case_calls(layer, w, fp8_modules, backends, x, ids, routing_weights)
    hf_names = [name for name in calls if name.startswith("hf_fp8_") and not name.startswith(FP8_TUTEL)]
    skipped.update(runnable(calls, [name for name in calls if name not in hf_names] + hf_names, device))
    runs = max(5, reps // 3) if tokens > 256 else reps
    timed = dict(calls, read_probe=probes.buffer.sum)
    times = interleaved_event_medians(timed, runs, warmup=1, before_each=flush)  # ms
    read_bytes_per_s = probes.bytes / (times["read_probe"] / 1e3)
    experts_read = int(ids.unique().numel())
    row: Dict[str, object] = {"model": layer.model, "format": layer.format, "T": tokens, "k": w.k,
                              "E": w.num_experts, "H": w.hidden, "I": w.inter, "experts_read": experts_read,
                              "reps": runs, "read_gbps": read_bytes_per_s / 1e9, "fp8_experts": fp8_modules is not None}
    for name in calls:
        row[f"{name}_ms"] = times[name]
    row.update(kernel_fields(calls, count))
    medians = functools.partial(interleaved_event_medians, before_each=flush)
    row.update(graph_replay_fields(calls, runs, medians=medians))
    limit_bytes = {name: experts_read * w.bytes_per_expert[name] for name in ("bf16",) + FORMATS}
    if fp8_modules is not None:  # FP8Experts over the fp8_block stacks' codes
        limit_bytes[FP8_TUTEL] = limit_bytes[f"{FP8_TUTEL}_weight_only"] = limit_bytes["fp8_block"]
    for name, read in limit_bytes.items():
        limit_ms = read / read_bytes_per_s * 1e3
        row[f"{name}_limit_ms"] = limit_ms
        row[f"{name}/limit"] = _ratio(row.get(f"{name}_ms"), limit_ms)
        row[f"{name}_graph/limit"] = _ratio(row.get(f"{name}_graph_ms"), limit_ms)
    for name in FORMATS:
        row[f"{name}/bf16"] = _ratio(row.get(f"{name}_ms"), row.get("bf16_ms"))
        row[f"{name}_graph/bf16_graph"] = _ratio(row.get(f"{name}_graph_ms"), row.get("bf16_graph_ms"))
    if fp8_modules is not None:
        row.update(fp8_comparison(row, hf_names, skipped))
    if skipped:
        row["skipped"] = skipped
    return row


def fp8_comparison(row: Dict[str, object], hf_names: Sequence[str], skipped: Dict[str, str]) -> Dict[str, object]:
    """transformers' fastest FP8 experts implementation, eager and replayed, against FP8Experts under tutel
    (W8A8 both): best_hf_fp8, best_hf_fp8/tutel, best_hf_fp8_graph, best_hf_fp8_graph/tutel_graph; None
    with why/<field> where transformers had none to compare."""
    out: Dict[str, object] = {}
    for suffix in ("", "_graph"):
        measured = [name for name in hf_names if name not in skipped and row.get(f"{name}{suffix}_ms") is not None]
        best = min(measured, key=lambda name: row[f"{name}{suffix}_ms"]) if measured else None
        key = f"best_hf_fp8{suffix}/tutel{suffix}"
        out[f"best_hf_fp8{suffix}"] = best[len("hf_fp8_"):] if best else None
        out[key] = _ratio(row[f"{best}{suffix}_ms"], row.get(f"{FP8_TUTEL}{suffix}_ms")) if best else None
        if best is None:
            reasons = [f"{name[len('hf_fp8_'):]}: {why}" for name, why in sorted(skipped.items())
                       if name.startswith("hf_fp8_") and not name.startswith(FP8_TUTEL)]
            out[f"why/{key}"] = "no FP8 experts implementation of transformers ran" + \
                (" (" + "; ".join(reasons) + ")" if reasons else "")
        elif out[key] is None:
            out[f"why/{key}"] = row.get(f"{FP8_TUTEL}{suffix}_error") or skipped.get(FP8_TUTEL) or "tutel not measured"
    return out


def cuda_cases(smoke: bool) -> List[Dict[str, object]]:
    """What a CUDA run measures, without running anything: per layer and token count, the candidates
    (tutel's bf16 call, its quantized call per format, FP8Experts under tutel and transformers'
    implementations where the layer fits FP8Experts) and the implementations left out, with why."""
    backends = fp8_experts_backends()
    cases = []
    for layer in LAYERS:
        fp8 = layer.family == "qwen3_moe" and bool(backends)  # gpt-oss' biases: FP8Experts has none
        candidates = ["bf16", *FORMATS]
        left_out = {}
        if fp8:
            candidates += [FP8_TUTEL, f"{FP8_TUTEL}_weight_only"]
            candidates += [f"hf_fp8_{name}" for name, why in backends.items() if why is None]
            left_out = {f"hf_fp8_{name}": why for name, why in backends.items() if why is not None}
        for tokens in (SMOKE_TOKEN_COUNTS if smoke else TOKEN_COUNTS):
            cases.append({"model": layer.model, "format": layer.format, "T": tokens, "candidates": candidates,
                          "left_out": left_out, "fp8_experts": fp8})
    return cases


CUDA_COLUMNS = (["model", "format", "T", "experts_read", "bf16_ms", "bf16_graph_ms"]
                + [c for f in FORMATS for c in (f"{f}_ms", f"{f}_graph_ms", f"{f}_graph/limit", f"{f}/bf16")]
                + [f"{FP8_TUTEL}_ms", f"{FP8_TUTEL}_weight_only_ms", "best_hf_fp8", "best_hf_fp8/tutel", "read_gbps"])
CUDA_KERNEL_COLUMNS = ["model", "T"] + [f"{name}_kernels" for name in ("bf16",) + FORMATS] + \
    [f"{FP8_TUTEL}_kernels", f"{FP8_TUTEL}_weight_only_kernels", f"{FP8_TUTEL}_graph_ms", "best_hf_fp8_graph",
     "best_hf_fp8_graph/tutel_graph"]


def main_cuda(args: argparse.Namespace, argv: Sequence[str]) -> Dict[str, object]:
    """The CUDA benchmark (see the module's docstring): writes quantized_experts_cuda.json."""
    device = torch.device("cuda")
    reps = args.reps
    probes = LimitProbes(torch.bfloat16, args.smoke, "cuda")
    flush = device_cache_reset(args.smoke, "cuda")
    backends = fp8_experts_backends()
    rows: List[Dict[str, object]] = []
    payload = {"rows": rows, "columns": CUDA_COLUMNS, "kernel_columns": CUDA_KERNEL_COLUMNS,
               "fp8_block": list(FP8_BLOCK), "fp8_backends": backends, "device": "cuda",
               "device_name": torch.cuda.get_device_name(device), "reps": reps,
               "activations": "bfloat16; tutel's quantized calls weight-only, FP8Experts W8A8 (dynamic)",
               "command": " ".join(["python benchmarks/quantized_experts.py"] + list(argv))}
    for layer in LAYERS:
        w = layer_weights(layer, args.smoke, "cuda")
        fp8 = fp8_experts_modules(w.config, *w.stacks["fp8_block"]) \
            if layer.family == "qwen3_moe" and backends else None
        for tokens in (SMOKE_TOKEN_COUNTS if args.smoke else TOKEN_COUNTS):
            try:
                rows.append(measure_cuda_case(layer, w, tokens, reps, probes, flush, fp8, backends))
            except Exception as error:  # noqa: BLE001 -- a case that fails (out of memory ...) is a result
                _settle(device)
                rows.append({"model": layer.model, "format": layer.format, "T": tokens, "fp8_experts": fp8 is not None,
                             "error": first_line(error)})
                print(f"{layer.model} T={tokens}: failed: {rows[-1]['error']}", flush=True)
                continue
            print(format_table(rows[-1:], present_columns(rows[-1:], CUDA_COLUMNS)), flush=True)
        del w, fp8
        torch.cuda.empty_cache()
        write_result(args.out, "quantized_experts_cuda", dict(payload, partial=True), args.smoke)  # kept if stopped
    payload["targets"] = judge(rows, args.smoke, CUDA_TARGETS)
    print(format_table(rows, present_columns(rows, CUDA_COLUMNS)))
    print(format_table(rows, present_columns(rows, CUDA_KERNEL_COLUMNS)))
    for verdict in payload["targets"]:
        print(verdict_line(verdict))
    write_result(args.out, "quantized_experts_cuda", payload, args.smoke)
    return payload


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, object]:
    given = list(sys.argv[1:] if argv is None else argv)
    own = argparse.ArgumentParser(add_help=False)
    own.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                     help="cpu (default: quantized_experts.json) or cuda (quantized_experts_cuda.json)")
    options, rest = own.parse_known_args(given)
    if options.device == "cuda":
        why = cuda_unavailable()
        if why is not None:
            raise SystemExit(why)
        return main_cuda(parse_args(__doc__.splitlines()[0], rest, default_reps=CUDA_REPS), given)
    args = parse_args(__doc__.splitlines()[0], rest, default_reps=15)
    token_counts = SMOKE_TOKEN_COUNTS if args.smoke else TOKEN_COUNTS
    read_buffer = torch.ones((1 << 14) if args.smoke else (1 << 28))  # 1 GiB of float32
    rows = []
    for layer in LAYERS:
        rows += time_layer(layer, token_counts, args.reps, args.smoke, read_buffer)
    targets = judge(rows, args.smoke)
    print(format_table(rows, COLUMNS))
    for verdict in targets:
        print(verdict_line(verdict))
    payload = {"rows": rows, "targets": targets, "fp8_block": list(FP8_BLOCK), "threads": torch.get_num_threads(),
               "activations": "bfloat16, weight-only"}
    write_result(args.out, "quantized_experts", payload, args.smoke)
    return payload


if __name__ == "__main__":
    main(sys.argv[1:])
