"""Decoding steps of experts with quantized weights on the CPU: tutel's decode_quantized_experts
(MXFP4, NVFP4, block-scaled FP8) against the bfloat16 decode path (tutel.ops.decode_experts, whose
CPU implementation is routed_gated_experts), at the layer shapes of gpt-oss-20b (H = I = 2880,
E = 32, k = 4, its clamped interleaved SwiGLU with biases) and Qwen3-30B-A3B (H = 2048, I = 768,
E = 128, k = 8, SwiGLU).

At decoding sizes a step must at least read the weights of the experts its tokens chose, once.
limit_ms is that floor for each candidate: the bytes of the distinct chosen experts' tensors in its
format (codes, scales, biases) over the read bandwidth measured in the same run (a sum over a
1 GiB buffer, timed interleaved with the candidates).  Before every timed call a sum over a buffer
twice the last-level cache evicts the weights (_limits.cache_reset), as the other layers of a model
would.  Reported per row: each candidate's median ms, its ms / limit_ms, and bf16_ms / its ms.

    python benchmarks/quantized_decode_cpu.py              # writes benchmarks/results/quantized_decode_cpu.json
    python benchmarks/quantized_decode_cpu.py --smoke      # tiny shapes, one repetition
"""
import sys
from typing import Dict, List, NamedTuple, Optional, Sequence

import torch

from _common import format_table, interleaved_medians, parse_args, write_result
from _limits import cache_reset

from tutel.ops.decode_experts import decode_experts
from tutel.ops.decode_quantized_experts import decode_quantized_experts
from tutel.ops.gated_units import SWIGLU, GatedUnit

FORMATS = ("mxfp4", "nvfp4", "fp8_block")
FP8_BLOCK = (128, 128)
COLUMNS = ["model", "T", "k", "E", "experts_read", "bf16_ms", "bf16/limit"] + \
    [column for f in FORMATS for column in (f"{f}_ms", f"{f}/limit", f"bf16/{f}")] + ["read_gbps", "foreign_cpus"]


class Layer(NamedTuple):
    model: str
    hidden: int
    inter: int
    experts: int
    k: int
    unit: GatedUnit
    biases: bool


LAYERS = [Layer("gpt-oss-20b", 2880, 2880, 32, 4, GatedUnit(1.702, 1.0, 7.0, interleaved=True), True),
          Layer("Qwen3-30B-A3B", 2048, 768, 128, 8, SWIGLU, False)]
SMOKE_LAYERS = [Layer("gpt-oss-like", 64, 32, 4, 2, GatedUnit(1.702, 1.0, 7.0, interleaved=True), True),
                Layer("Qwen3-like", 64, 32, 8, 4, SWIGLU, False)]


class QuantizedStack(NamedTuple):
    codes: torch.Tensor
    scales: torch.Tensor
    global_scale: Optional[torch.Tensor]

    def bytes_per_expert(self) -> int:
        tensors = [self.codes, self.scales] + ([self.global_scale] if self.global_scale is not None else [])
        return sum(t.numel() * t.element_size() for t in tensors) // self.codes.shape[0]


def quantized_stack(format: str, experts: int, rows: int, cols: int) -> QuantizedStack:
    """Random codes and scales of moderate size (the time does not depend on the values)."""
    if format == "fp8_block":
        raw = torch.randint(0, 0x70, (experts, rows, cols), dtype=torch.uint8)  # no NaN codes
        scales = torch.rand(experts, -(-rows // FP8_BLOCK[0]), -(-cols // FP8_BLOCK[1])) * 1e-3
        return QuantizedStack(raw.view(torch.float8_e4m3fn), scales, None)
    codes = torch.randint(0, 256, (experts, rows, cols // 2), dtype=torch.uint8)
    if format == "mxfp4":
        return QuantizedStack(codes, torch.randint(118, 124, (experts, rows, cols // 32), dtype=torch.uint8), None)
    scales = torch.randint(0x20, 0x40, (experts, rows, cols // 16), dtype=torch.uint8).view(torch.float8_e4m3fn)
    return QuantizedStack(codes, scales, torch.rand(experts) * 0.01)


def bf16_stack(experts: int, rows: int, cols: int) -> torch.Tensor:
    weights = torch.empty(experts, rows, cols, dtype=torch.bfloat16)
    for e in range(experts):  # one expert at a time: no float32 copy of the whole stack
        weights[e].normal_(std=cols ** -0.5)
    return weights


def routing(tokens: int, layer: Layer, seed: int):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(layer.experts, generator=gen)[:layer.k] for _ in range(tokens)]) \
        if tokens else torch.zeros(0, layer.k, dtype=torch.int64)
    weights = torch.softmax(torch.randn(tokens, layer.k, generator=gen), dim=-1)
    return ids, weights


def time_layer(layer: Layer, token_counts: Sequence[int], reps: int, smoke: bool,
               read_buffer: torch.Tensor) -> List[Dict[str, object]]:
    h, i, e = layer.hidden, layer.inter, layer.experts
    up_rows = 2 * i
    gate_up_bias = torch.randn(e, up_rows) * 0.1 if layer.biases else None
    down_bias = torch.randn(e, h) * 0.1 if layer.biases else None
    bias_bytes = (up_rows + h) * 4 if layer.biases else 0
    bf16 = (bf16_stack(e, up_rows, h), bf16_stack(e, h, i))
    bf16_bias = [b.to(torch.bfloat16) if b is not None else None for b in (gate_up_bias, down_bias)]
    stacks = {f: (quantized_stack(f, e, up_rows, h), quantized_stack(f, e, h, i)) for f in FORMATS}
    bytes_per_expert = {"bf16": (up_rows * h + h * i) * 2 + bias_bytes // 2}
    bytes_per_expert.update({f: gu.bytes_per_expert() + d.bytes_per_expert() + bias_bytes
                             for f, (gu, d) in stacks.items()})
    reset = cache_reset(smoke)
    rows = []
    for tokens in token_counts:
        x = torch.randn(tokens, h).to(torch.bfloat16)
        ids, weights = routing(tokens, layer, seed=tokens)

        def quantized(format):
            gu, d = stacks[format]
            return lambda: decode_quantized_experts(
                x, ids, weights, format, gu.codes, gu.scales, d.codes, d.scales, gate_up_global=gu.global_scale,
                down_global=d.global_scale, block=FP8_BLOCK if format == "fp8_block" else None,
                gate_up_bias=gate_up_bias, down_bias=down_bias, unit=layer.unit)

        candidates = {"bf16": lambda: decode_experts(x, ids, weights, bf16[0], bf16[1], up_bias=bf16_bias[0],
                                                     down_bias=bf16_bias[1], unit=layer.unit),
                      **{f: quantized(f) for f in FORMATS},
                      "read_probe": read_buffer.sum}
        with torch.inference_mode():
            times = interleaved_medians(candidates, reps, warmup=1 if smoke else 2, before_each=reset)
        read_bytes_per_s = read_buffer.numel() * read_buffer.element_size() / times["read_probe"]
        experts_read = int(ids.unique().numel())
        row = {"model": layer.model, "T": tokens, "k": layer.k, "E": e, "experts_read": experts_read,
               "read_gbps": read_bytes_per_s / 1e9, "foreign_cpus": times.foreign_cpus}
        for name in ("bf16",) + FORMATS:
            limit_s = experts_read * bytes_per_expert[name] / read_bytes_per_s
            row[f"{name}_ms"] = times[name] * 1e3
            row[f"{name}/limit"] = times[name] / limit_s if limit_s else None
            if name != "bf16":
                row[f"bf16/{name}"] = times["bf16"] / times[name]
        rows.append(row)
    return rows


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, object]:
    args = parse_args(__doc__.splitlines()[0], argv, default_reps=15)
    layers = SMOKE_LAYERS if args.smoke else LAYERS
    token_counts = (1, 3) if args.smoke else (1, 8, 32)
    read_buffer = torch.ones((1 << 14) if args.smoke else (1 << 28))  # 1 GiB of float32
    rows = []
    for layer in layers:
        rows += time_layer(layer, token_counts, args.reps, args.smoke, read_buffer)
    print(format_table(rows, COLUMNS))
    payload = {"rows": rows, "fp8_block": list(FP8_BLOCK), "threads": torch.get_num_threads()}
    write_result(args.out, "quantized_decode_cpu", payload, args.smoke)
    return payload


if __name__ == "__main__":
    main(sys.argv[1:])
