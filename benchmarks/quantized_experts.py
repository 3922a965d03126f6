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

The quantized stacks hold random codes and scales of moderate size: the time does not depend on
the values (tests/python hold the values to float64 references).

    python benchmarks/quantized_experts.py              # writes benchmarks/results/quantized_experts.json
    python benchmarks/quantized_experts.py --smoke      # tiny shapes, one repetition
"""
import sys
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence

import torch

from _common import format_table, interleaved_medians, parse_args, write_result
from _hf_blocks import build_block
from _limits import cache_reset

from tutel.experts import routed_experts, routed_quantized_experts
from tutel.ops.gated_units import SWIGLU, GatedUnit
from tutel.quant import Fp8BlockWeights, Mxfp4Weights, Nvfp4Weights, QuantizedWeights

FORMATS = ("mxfp4", "nvfp4", "fp8_block")
FP8_BLOCK = (128, 128)
TRANSFORMERS = ("eager", "grouped_mm")
TOKEN_COUNTS = (1, 16, 2048)
SMOKE_TOKEN_COUNTS = (1, 3, 40)
# (the fp4 formats take rows of whole 32-element blocks)
SMOKE_SIZES = dict(hidden_size=64, intermediate_size=32, moe_intermediate_size=32)
#: (tokens, format, the bound, what is bounded): the quantized path's targets.
TARGETS = [(1, "mxfp4", 3.0, "bf16/mxfp4 >="), (1, "mxfp4", 1.3, "mxfp4/limit <="),
           (1, "fp8_block", 1.7, "bf16/fp8_block >=")] + \
          [(2048, f, 1.15, f"{f}/bf16 <=") for f in FORMATS]
COLUMNS = ["model", "T", "experts_read", "bf16_ms", "bf16/limit"] + \
    [f"hf_{name}_ms" for name in TRANSFORMERS] + \
    [column for f in FORMATS for column in (f"{f}_ms", f"{f}/limit", f"bf16/{f}")] + ["read_gbps", "foreign_cpus"]


class Layer(NamedTuple):
    model: str
    family: str  # benchmarks/_hf_blocks.py's family name
    unit: GatedUnit


LAYERS = [Layer("gpt-oss-20b", "gpt_oss", GatedUnit(1.702, 1.0, 7.0, interleaved=True)),
          Layer("Qwen3-30B-A3B", "qwen3_moe", SWIGLU)]


def random_stack(format: str, experts: int, rows: int, cols: int) -> QuantizedWeights:
    """A stack of random codes and moderate scales in `format` (no NaN codes or scales)."""
    if format == "fp8_block":
        codes = torch.randint(0, 0x70, (experts, rows, cols), dtype=torch.uint8).view(torch.float8_e4m3fn)
        scales = torch.rand(experts, -(-rows // FP8_BLOCK[0]), -(-cols // FP8_BLOCK[1])) * 1e-3
        return Fp8BlockWeights(codes, scales, block=FP8_BLOCK)
    codes = torch.randint(0, 256, (experts, rows, cols // 2), dtype=torch.uint8)
    if format == "mxfp4":
        return Mxfp4Weights(codes, torch.randint(118, 124, (experts, rows, cols // 32), dtype=torch.uint8))
    scales = torch.randint(0x20, 0x40, (experts, rows, cols // 16), dtype=torch.uint8).view(torch.float8_e4m3fn)
    return Nvfp4Weights(codes, scales, torch.rand(experts) * 0.01)


def routing(tokens: int, experts: int, k: int, seed: int):
    """Each token's k distinct experts (uniform) and softmax weights."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(tokens)]) \
        if tokens else torch.zeros(0, k, dtype=torch.int64)
    return ids, torch.softmax(torch.randn(tokens, k, generator=gen), dim=-1)


def _stacks_bytes(stacks: Sequence[QuantizedWeights]) -> int:
    return sum(stack.packed_bytes() for stack in stacks)


def time_layer(layer: Layer, token_counts: Sequence[int], reps: int, smoke: bool,
               read_buffer: torch.Tensor) -> List[Dict[str, object]]:
    block = build_block(layer.family, torch.bfloat16, smoke, full_size=not smoke, sizes=SMOKE_SIZES if smoke else None)
    experts, config = block.experts, block.config
    k = config.num_experts_per_tok
    # transformers' experts: [E, 2I, H] / [E, H, I], or transposed ([E, H, 2I] / [E, I, H]) in gpt-oss
    transposed = bool(getattr(experts, "is_transposed", False))
    gate_up, down = experts.gate_up_proj.detach(), experts.down_proj.detach()
    num_experts = gate_up.shape[0]
    up_rows, hidden = (gate_up.shape[2], gate_up.shape[1]) if transposed else gate_up.shape[1:]
    inter = up_rows // 2
    up_bias = getattr(experts, "gate_up_proj_bias", None)
    down_bias = getattr(experts, "down_proj_bias", None)
    biases = [b.detach().float() if b is not None else None for b in (up_bias, down_bias)]
    bias_bytes = sum(b[0].numel() * 4 for b in biases if b is not None)
    stacks = {f: (random_stack(f, num_experts, up_rows, hidden), random_stack(f, num_experts, hidden, inter))
              for f in FORMATS}
    bytes_per_expert = {"bf16": (gate_up[0].numel() + down[0].numel()) * 2 + bias_bytes // 2}
    bytes_per_expert.update({f: _stacks_bytes(pair) // num_experts + bias_bytes for f, pair in stacks.items()})
    bf16_biases = [b.to(torch.bfloat16) if b is not None else None for b in biases]
    reset = cache_reset(smoke)
    rows = []
    for tokens in token_counts:
        x = torch.randn(tokens, hidden).to(torch.bfloat16)
        ids, weights = routing(tokens, num_experts, k, seed=tokens)
        weights = weights.to(torch.bfloat16)

        def quantized(format: str) -> Callable[[], object]:
            up, dn = stacks[format]
            return lambda: routed_quantized_experts(x, ids, weights, up, dn, gate=layer.unit,
                                                    up_bias=biases[0], down_bias=biases[1])

        def transformers_call(implementation: str) -> Callable[[], object]:
            def run():
                config._experts_implementation = implementation
                experts(x, ids, weights)
            return run

        candidates = {"bf16": lambda: routed_experts(x, ids, weights, gate_up, down, up_bias=bf16_biases[0],
                                                     down_bias=bf16_biases[1], transposed=transposed,
                                                     gate=layer.unit),
                      **{f"hf_{name}": transformers_call(name) for name in TRANSFORMERS},
                      **{f: quantized(f) for f in FORMATS},
                      "read_probe": read_buffer.sum}
        runs = max(3, reps // 5) if tokens > 256 else reps
        with torch.inference_mode():
            times = interleaved_medians(candidates, runs, warmup=1, before_each=reset)
        read_bytes_per_s = read_buffer.numel() * read_buffer.element_size() / times["read_probe"]
        experts_read = int(ids.unique().numel())
        row = {"model": layer.model, "T": tokens, "k": k, "E": num_experts, "H": hidden, "I": inter,
               "experts_read": experts_read, "read_gbps": read_bytes_per_s / 1e9, "foreign_cpus": times.foreign_cpus}
        for name in TRANSFORMERS:
            row[f"hf_{name}_ms"] = times[f"hf_{name}"] * 1e3
        for name in ("bf16",) + FORMATS:
            limit_s = experts_read * bytes_per_expert[name] / read_bytes_per_s
            row[f"{name}_ms"] = times[name] * 1e3
            row[f"{name}/limit"] = times[name] / limit_s if limit_s else None
            if name != "bf16":
                row[f"bf16/{name}"] = times["bf16"] / times[name]
                row[f"{name}/bf16"] = times[name] / times["bf16"]
        rows.append(row)
    return rows


def judge(rows: Sequence[Dict[str, object]], smoke: bool) -> List[Dict[str, object]]:
    """Each target on each layer: the measured value and whether it holds."""
    verdicts = []
    for tokens, format, bound, what in TARGETS:
        tokens = {2048: SMOKE_TOKEN_COUNTS[-1]}.get(tokens, tokens) if smoke else tokens
        key = what.split()[0]
        for row in rows:
            if row["T"] != tokens or row.get(key) is None:
                continue
            value = row[key]
            met = value >= bound if what.endswith(">=") else value <= bound
            verdicts.append({"model": row["model"], "T": tokens, "target": f"{what} {bound}", "value": value,
                             "met": bool(met)})
    return verdicts


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, object]:
    args = parse_args(__doc__.splitlines()[0], argv, default_reps=15)
    token_counts = SMOKE_TOKEN_COUNTS if args.smoke else TOKEN_COUNTS
    read_buffer = torch.ones((1 << 14) if args.smoke else (1 << 28))  # 1 GiB of float32
    rows = []
    for layer in LAYERS:
        rows += time_layer(layer, token_counts, args.reps, args.smoke, read_buffer)
    targets = judge(rows, args.smoke)
    print(format_table(rows, COLUMNS))
    for verdict in targets:
        print(f"{verdict['model']} T={verdict['T']}: {verdict['target']}: {verdict['value']:.2f} "
              f"({'met' if verdict['met'] else 'NOT met'})")
    payload = {"rows": rows, "targets": targets, "fp8_block": list(FP8_BLOCK), "threads": torch.get_num_threads(),
               "activations": "bfloat16, weight-only"}
    write_result(args.out, "quantized_experts", payload, args.smoke)
    return payload


if __name__ == "__main__":
    main(sys.argv[1:])
