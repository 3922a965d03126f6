"""Which path runs a call, and why: the one place where tutel decides how a call is executed.

A caller describes its call with *facts* (the device, whether autograd records it, the switches,
what the experts offer, ...; FACTS below says what each means) and asks ``choose_path``; the
first rule of its entry whose conditions all hold names the path, with the reason.  The rules
are data, so the same table is the code and the documentation: docs/design.md shows
``path_table()`` and a test keeps the two equal.

Two entries choose: ``"layer"`` (``moe_layer.forward``: routing, the experts and the combine)
and ``"experts"`` (``tutel.experts.routed_experts`` and transformers' "tutel" experts, whose
tokens come routed).
"""
from enum import Enum
from typing import Dict, Mapping, NamedTuple, Tuple, Union

import torch

LAYER = "layer"
EXPERTS = "experts"
ENTRIES = (LAYER, EXPERTS)


class Path(str, Enum):
    """The execution paths (tutel.paths.table gives each one its routing and stages)."""

    EXPERT_PARALLEL = "expert_parallel"      # [E, C, M] buffers exchanged between the processes
    STATIC_DECODE = "static_decode"          # route_experts, then decode_experts (CUDA kernels, no autograd)
    STATIC_SLOTS = "static_slots"            # route_experts, Tutel's [E, C, M] slots through the module (bmm)
    DROPLESS_SLOTS = "dropless_slots"        # the same, C the largest load read on the host
    STATIC_GROUPED = "static_grouped"        # route_experts plans a grouped buffer of static size on the device
    LAYER_IN_TWO_CALLS = "layer_in_two_calls"  # route_without_grad, then routed_gated_experts (C++)
    GROUPED_ONE_CALL = "grouped_one_call"    # the layer's routing, then routed_gated_experts (C++)
    GROUPED_PIECES = "grouped_pieces"        # the layer's routing, then the grouped rows in pieces
    GROUPED = "grouped"                      # [N, M] grouped rows through autograd (megablocks)
    PADDED = "padded"                        # Tutel's [E, C, M] buffer through the experts module
    EXPERTS_ONE_CALL = "experts_one_call"    # routed_gated_experts (C++), one operator call
    EXPERTS_QUANTIZED_DECODE = "experts_quantized_decode"  # decode_quantized_experts (C++), one operator call
    EXPERTS_PIECES = "experts_pieces"        # grouped rows in pieces, the operators called directly
    EXPERTS_DECODE = "experts_decode"        # decode_experts (CUDA kernels), one operator call
    EXPERTS_PER_EXPERT = "experts_per_expert"  # grouped rows, the ends read on the host, a product per expert
    EXPERTS_GROUPED = "experts_grouped"      # one grouped buffer through autograd, any device


FactValue = Union[bool, str]

FACTS: Dict[str, str] = {
    "device": "device type of the tokens: `cpu`, `cuda` or `other`",
    "gradient": "autograd records the call (grad mode on and a tensor of the call requires grad)",
    "traced": "torch.compile traces the call",
    "capturing": "a CUDA graph is being captured on the current stream (torch.cuda.is_current_stream_capturing; "
                 "asked only for eager CUDA tokens of a cublas_dtype): nothing may be read back to the host",
    "cublas_dtype": "the tokens are float16, float32 or float64, for which PyTorch's grouped_mm has no kernel: "
                    "PyTorch's matrix products (cuBLAS on CUDA, tensor cores for float16, TF32 for float32 "
                    "where torch.backends.cuda.matmul allows it) multiply them",
    "plain": "eager, plain tensors: not traced, no Python dispatch mode active, no tensor subclass (tutel's "
             "C++ functions may then be called directly, without the dispatcher)",
    "autocast": "autocast is enabled for the device",
    "processes": "`one`, or `several` processes hold the experts",
    "layout": "layer: `grouped` (megablocks_size > 0) or `padded` ([E, C, M])",
    "capacity": "layer: `static` (capacity_factor > 0), `dropless` (0) or `capped` (< 0)",
    "tutel_routing": "layer: softmax top-k routing with the GShard loss, no scored-routing options, no gate "
                     "noise in training",
    "gate_at_combine": "layer: is_postscore (the gates weight the experts' outputs at the combine)",
    "token_dims": "layer: `one` trailing dim per token (reserve_dims = 1) or `several`",
    "gated_experts": "the experts are a fused gated unit (SwiGLU, gpt-oss') whose matrices run in one "
                     "operator call (no post-expert function, weights in the tokens' dtype)",
    "experts_in_pieces": "layer: the experts offer grouped_products (their products on grouped rows)",
    "experts_grouped": "layer: the experts offer forward_grouped (grouped rows through autograd)",
    "rows_fit_one_call": "tokens x k choices fit one operator call (tutel.paths.facts.fits_one_call)",
    "decode_kernel": "tutel's decode_experts kernels take the call: CUDA, up to 32 tokens and 256 choices, "
                     "within the line measured for the GPU and dtype (tutel.ops.decode_experts."
                     "decode_experts_supported)",
    "quantized_decode": "tutel's decode_quantized_experts operator takes the quantized experts' call: CPU or CUDA "
                        "tokens, weight-only, a GatedUnit or an up-only gelu / relu it recognises, no gate stack of "
                        "their own, float32 / bfloat16 / float16 tokens, up to 32 of them "
                        "(tutel.rules.lines.QUANTIZED_DECODE_MAX_TOKENS)",
}


class Rule(NamedTuple):
    """``path`` runs a call of ``entry`` when every fact named in ``when`` has one of its values."""
    entry: str
    path: Path
    when: Tuple[Tuple[str, Tuple[FactValue, ...]], ...]
    reason: str


class PathChoice(NamedTuple):
    """The path a call takes, and the reason."""
    path: Path
    reason: str


def _rule(entry: str, path: Path, reason: str, **when: Union[FactValue, Tuple[FactValue, ...]]) -> Rule:
    for fact in when:
        if fact not in FACTS:
            raise KeyError(f"rule for {path.value} names an unknown fact {fact!r}")
    return Rule(entry, path, tuple((fact, value if isinstance(value, tuple) else (value,))
                                   for fact, value in when.items()), reason)


_CPU_INFERENCE = dict(device="cpu", gradient=False, traced=False)

RULES: Tuple[Rule, ...] = (
    _rule(LAYER, Path.EXPERT_PARALLEL, "several processes hold the experts: tokens go to the process of "
          "their expert and back", processes="several"),
    _rule(LAYER, Path.STATIC_DECODE, "CUDA inference of Tutel's dropless routing with SwiGLU experts at decoding "
          "sizes: the routing in two launches, then each chosen expert's matrices read once by the decode "
          "kernels; no host synchronisation", device="cuda", gradient=False, processes="one", capacity="dropless",
          tutel_routing=True, gate_at_combine=True, token_dims="one", gated_experts=True, decode_kernel=True),
    _rule(LAYER, Path.STATIC_SLOTS, "CUDA, one process, a static capacity, float16 / float32 / float64: the "
          "routing in two launches, then Tutel's [E, C, M] slots through the experts module (cuBLAS bmm for the "
          "built-in experts); no host synchronisation, so CUDA graphs capture it", device="cuda", processes="one",
          capacity="static", tutel_routing=True, token_dims="one", cublas_dtype=True),
    _rule(LAYER, Path.DROPLESS_SLOTS, "CUDA, one process, dropless, float16 / float32 / float64, eager: the "
          "largest load read on the host (one synchronisation, as Tutel's dropless capacity) sizes the [E, C, M] "
          "slots the experts module multiplies with cuBLAS", device="cuda", processes="one", capacity="dropless",
          tutel_routing=True, token_dims="one", cublas_dtype=True, capturing=False, traced=False),
    _rule(LAYER, Path.STATIC_GROUPED, "CUDA, one process: the routing plans a grouped buffer of static size "
          "(T x k rows dropless, E x capacity) on the device and the experts' grouped products run over it; no "
          "host synchronisation, so CUDA graphs capture it", device="cuda", processes="one",
          capacity=("static", "dropless"), tutel_routing=True, token_dims="one", experts_in_pieces=True),
    _rule(LAYER, Path.LAYER_IN_TWO_CALLS, "CPU inference of Tutel's routing with SwiGLU experts at decoding "
          "sizes: routing in one C++ pass, the experts in one operator call", **_CPU_INFERENCE, plain=True,
          autocast=False,
          layout="grouped", capacity=("static", "dropless"), tutel_routing=True, gate_at_combine=True,
          token_dims="one", gated_experts=True, rows_fit_one_call=True),
    _rule(LAYER, Path.GROUPED_ONE_CALL, "CPU inference with SwiGLU experts at decoding sizes: the experts, "
          "grouping and combine in one operator call", **_CPU_INFERENCE, layout="grouped", gate_at_combine=True,
          token_dims="one", gated_experts=True, rows_fit_one_call=True),
    _rule(LAYER, Path.GROUPED_PIECES, "CPU inference on the grouped layout: the kept rows in bounded pieces, "
          "no autograd wrappers", **_CPU_INFERENCE, layout="grouped", gate_at_combine=True, token_dims="one",
          experts_in_pieces=True),
    _rule(LAYER, Path.GROUPED, "megablocks_size > 0: each expert computes only its occupied rows",
          layout="grouped", experts_grouped=True),
    _rule(LAYER, Path.PADDED, "Tutel's [E, C, M] expert buffer (any experts module)"),
    _rule(EXPERTS, Path.EXPERTS_ONE_CALL, "CPU inference of gated experts at decoding sizes: one operator call",
          **_CPU_INFERENCE, gated_experts=True, rows_fit_one_call=True),
    _rule(EXPERTS, Path.EXPERTS_QUANTIZED_DECODE, "CPU or CUDA inference of quantized experts at decoding sizes: "
          "each chosen expert's packed codes read once and decoded as they are read, in one operator call (two "
          "kernels on CUDA, no host synchronisation)", device=("cpu", "cuda"), gradient=False, traced=False,
          quantized_decode=True),
    _rule(EXPERTS, Path.EXPERTS_PIECES, "CPU inference: the kept rows in bounded pieces, the operators called "
          "directly", **_CPU_INFERENCE),
    _rule(EXPERTS, Path.EXPERTS_DECODE, "CUDA inference of gated experts at decoding sizes: each chosen expert's "
          "matrices read once by the decode kernels (two launches)", device="cuda", gradient=False,
          gated_experts=True, decode_kernel=True),
    _rule(EXPERTS, Path.EXPERTS_PER_EXPERT, "CUDA, float16 / float32 / float64, eager: the group ends read on the "
          "host (one synchronisation), then one cuBLAS product per expert with rows (tutel.ops.per_expert_mm)",
          device="cuda", cublas_dtype=True, capturing=False, traced=False),
    _rule(EXPERTS, Path.EXPERTS_GROUPED, "one grouped buffer through autograd (training, tracing, devices; "
          "quantized experts on CUDA past decoding sizes: their grouped products, no host synchronisation)"),
)


def _first_rule(entry: str, facts: Mapping[str, FactValue]) -> PathChoice:
    for rule in RULES:
        if rule.entry == entry and all(facts.get(fact) in allowed for fact, allowed in rule.when):
            return PathChoice(rule.path, rule.reason)
    raise ValueError(f"choose_path: entry must be one of {ENTRIES}, got {entry!r}")


# The answers so far, by the call's facts, for the rules they came from: a handful of fact
# combinations recur call after call, and looking one up costs one tuple and one dict probe where
# trying the rules costs a generator each.
_ANSWERS: Dict[Tuple[object, ...], PathChoice] = {}
_ANSWERED_RULES = RULES
_FACT_NAMES = tuple(FACTS)


def choose_path(entry: str, facts: Mapping[str, FactValue]) -> PathChoice:
    """The path of a call of `entry` ("layer" or "experts") described by `facts` (names from FACTS;
    a fact a rule needs but `facts` lacks counts as not holding), with the reason."""
    global _ANSWERED_RULES
    if torch.compiler.is_compiling():  # traced: the rules themselves, no global state to guard on
        return _first_rule(entry, facts)
    if RULES is not _ANSWERED_RULES:  # the rules were replaced (a test, a user's own table)
        _ANSWERS.clear()
        _ANSWERED_RULES = RULES
    key = (entry, *map(facts.get, _FACT_NAMES))
    choice = _ANSWERS.get(key)
    if choice is None:
        choice = _ANSWERS[key] = _first_rule(entry, facts)
    return choice


def _describe(value: FactValue) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    return value


def path_table() -> str:
    """The rules as a markdown table, in the order they are tried (docs/design.md shows it)."""
    lines = ["| entry | path | when | why |", "|---|---|---|---|"]
    for rule in RULES:
        when = ", ".join(f"{fact} = {' or '.join(_describe(v) for v in allowed)}" for fact, allowed in rule.when)
        lines.append(f"| {rule.entry} | `{rule.path.value}` | {when or 'otherwise'} | {rule.reason} |")
    return "\n".join(lines)


def facts_table() -> str:
    """FACTS as a markdown list (docs/design.md shows it under the table)."""
    return "\n".join(f"* `{name}`: {meaning}" for name, meaning in FACTS.items())
