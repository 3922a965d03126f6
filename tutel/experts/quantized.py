"""Routed experts whose matrices are quantized stacks (tutel.quant), for inference on the CPU and CUDA.

``routed_quantized_experts(x, expert_ids, weights, up, down, ...)`` computes what
``routed_experts`` computes,

    y[t] = sum_j  weights[t, j] * down_e( gate( up_e(x[t]) ) ),   e = expert_ids[t, j]

where ``up_e(v) = v @ Wup[e]^T + up_bias[e]`` and ``down_e(v) = v @ Wdown[e]^T + down_bias[e]``
(the biases optional, of any floating dtype, added in the products' accumulation dtype), with each
expert's matrices dequantized one expert at a time (never a whole stack in floating point), the
products accumulated in float32 (float64 for float64 tokens) and the activations kept in the
tokens' dtype between them (tutel.ops.quantized_experts).  ``up_bias`` is laid out as the values
the gate rule reads: like `up`'s rows ([E, U]; interleaved for gpt-oss' interleaved unit), or
[E, 2I] for [gate | up] where the gates are a stack of their own (`gate_weight`).
``activations="dynamic"`` quantizes each product's input as W8A8 block-FP8 checkpoints prescribe
(DeepSeek-V3's rule, per token and per block of columns); ``"weight_only"`` (the default) takes the
activations as they are.  Choices whose id lies outside [0, E) contribute nothing.

The call runs on the experts entry's paths (tutel.rules.paths).  Up to 32 tokens
(tutel.rules.lines.QUANTIZED_DECODE_MAX_TOKENS) of float32 / bfloat16 / float16 with weight-only
activations, a GatedUnit (``"swiglu"``) or an up-only F.gelu / F.relu / nn.GELU / nn.ReLU, and
no gate stack of its own, one call of tutel's decode_quantized_experts operator reads each chosen
expert's packed codes once, summing in float32 and keeping the units' values in the tokens' dtype
between the products (the ``quantized_decode`` fact).
Otherwise the choices are sorted by expert, and on the CPU the kept rows run in bounded pieces,
each piece's outputs weighted and added up; on CUDA the rows are grouped by expert on the device
(group_by_expert), both products run tutel's quantized_grouped_linear over all of them (the group
ends an int32 device tensor), the unit between them, and the weighted combine gathers each token's
rows: no host synchronisation on either path, so CUDA graphs capture them.  The tokens, the
routing, the stacks and the biases must lie on one device (ValueError otherwise); float64 tokens
run on the CPU only (TypeError on CUDA).  A call that autograd would record raises
NotImplementedError (quantized experts run inference only; the tokens, the routing weights and the
biases count).
"""
import weakref
from typing import Callable, NamedTuple, Optional, Union

import torch

from ..ops.gated_units import GatedUnit, check_unit
from ..ops.quantized_experts import (ACTIVATIONS, WEIGHT_ONLY, check_expert_biases, check_quantized_experts,
                                     require_rows_dtype, require_same_device)
from ..paths import QuantizedExperts, Work, run
from ..paths.facts import quantized_experts_facts
from ..paths.work import NOT_ASKED
from ..quant.base import QuantizedWeights
from ..rules.paths import EXPERTS, choose_path
from .routed import GATES, check_gate_rule, check_routing, gate_unit_of

WHERE = "tutel.experts.routed_quantized_experts"


def _check_experts(up, down, gate_weight, gate, gate_fn, activation, activations, up_bias, down_bias) -> int:
    """Checks what a call's experts are made of (the stacks, the gate rule, the biases); returns the
    width H of the tokens they take."""
    check_gate_rule(gate, gate_fn, activation, WHERE, f"{'/'.join(GATES)} or a GatedUnit")
    unit = gate_unit_of(gate)
    if unit is not None:
        check_unit(unit, WHERE)
        if unit.interleaved and gate_weight is not None:
            raise ValueError(f"{WHERE}: with `gate_weight` the gate rule sees [gate | up] concatenated; an "
                             f"interleaved unit does not apply")
    for name, value in (("gate_fn", gate_fn), ("activation", activation)):
        if value is not None and not callable(value):
            raise TypeError(f"{WHERE}: `{name}` must be callable, got {type(value).__name__}")
    width = check_quantized_experts(up, down, gate_weight, gate is not None or gate_fn is not None, activations,
                                    WHERE)
    check_expert_biases(up_bias, down_bias, up, down, gate_weight, WHERE)
    return width


def _check_tokens(x, expert_ids, weights, up, width: int) -> None:
    """Checks a call's own tensors (their routing checked first) against its (checked) experts."""
    if x.shape[1] != width:
        raise ValueError(f"{WHERE}: `x` {tuple(x.shape)} must have the {width} features the up projection "
                         f"{up.shape} takes")
    device = up.device
    for name, tensor in (("x", x), ("expert_ids", expert_ids), ("weights", weights)):
        if tensor is not None:
            require_same_device(tensor.device, device, f"{WHERE}: `{name}`")
    require_rows_dtype(x.dtype, x.device, f"{WHERE}: `x`")


class _Checked(NamedTuple):
    """What the checks of one set of experts found, kept for the next call with the same ones."""
    held: tuple            # weak references to down, gate_weight, up_bias, down_bias (None for None)
    biases: tuple          # the biases' (shape, dtype, device): what an assignment to .data changes
    width: int             # the tokens' width H
    form: object           # the decode form (QuantizedExperts.decode_form)


#: Per `up` stack (weakly: a stack dies with its last user), the checks of the experts it went
#: into, by the ids of the other parts.  The entries hold no strong reference to anything, so
#: they keep no stack or bias alive.  A model calls with the same stacks on every step; checking
#: them again costs as much Python as the rest of a one-token call.
_CHECKED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_CHECKED_PER_STACK = 8  # entries kept per `up` stack (a stack serves one layer in a model)


def _experts_key(down, gate_weight, gate, activations, up_bias, down_bias) -> tuple:
    """The key of a set of experts among its `up` stack's kept checks."""
    return id(down), id(gate_weight), gate, activations, id(up_bias), id(down_bias)


def _bias_facts(*biases) -> tuple:
    return tuple(None if b is None else (b.shape, b.dtype, b.device) for b in biases)


def _held(*parts) -> tuple:
    return tuple(None if part is None else weakref.ref(part) for part in parts)


def _kept_checks(up, down, gate_weight, gate, activations, up_bias, down_bias) -> Optional[_Checked]:
    """The kept checks of these experts (a gate given as a name or a GatedUnit, no gate_fn or
    activation callable: their identity cannot be held weakly), or None."""
    kept = _CHECKED.get(up) if isinstance(up, QuantizedWeights) else None
    if kept is None:
        return None
    entry = kept.get(_experts_key(down, gate_weight, gate, activations, up_bias, down_bias))
    if entry is None:
        return None
    for ref, part in zip(entry.held, (down, gate_weight, up_bias, down_bias)):
        if (part is not None) if ref is None else ref() is not part:
            return None  # an id reused by another object
    if entry.biases != _bias_facts(up_bias, down_bias):
        return None
    return entry


def _keep_checked(up, down, gate_weight, gate, activations, up_bias, down_bias, width: int, form: object) -> None:
    try:
        kept = _CHECKED.setdefault(up, {})
    except TypeError:  # not weakly referable (a stack type of a user's own, say): nothing kept
        return
    if len(kept) >= _CHECKED_PER_STACK:
        kept.clear()
    kept[_experts_key(down, gate_weight, gate, activations, up_bias, down_bias)] = _Checked(
        _held(down, gate_weight, up_bias, down_bias), _bias_facts(up_bias, down_bias), width, form)


def routed_quantized_experts(x: torch.Tensor, expert_ids: torch.Tensor, weights: Optional[torch.Tensor], up,
                             down, *, gate_weight=None, gate: Union[None, str, GatedUnit] = None,
                             gate_fn: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
                             activation: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
                             activations: str = WEIGHT_ONLY, up_bias: Optional[torch.Tensor] = None,
                             down_bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The routing-weighted sum of each token's quantized experts (see the module docstring).

    Args:
        x: [T, H] tokens on the stacks' device: float32, bfloat16 or float16 (and float64 on the CPU).
        expert_ids: [T, k] integer expert ids; ids outside [0, E) contribute nothing.
        weights: [T, k] routing weight of each choice; None means 1.
        up: a tutel.quant stack (E, U, H): U = 2I gate and up rows for gated experts (the rows
            ``gate`` / ``gate_fn`` read, e.g. transformers' [gate; up]), U = I otherwise; with
            `gate_weight`, the ups alone (E, I, H).
        down: a tutel.quant stack (E, O, I).
        gate_weight: optional stack (E, I, H) of the gates' own matrices (a checkpoint whose gate and
            up projections are quantized apart); the gate rule then sees [gate | up].
        gate: ``"swiglu"`` or a tutel.ops.gated_units.GatedUnit (fused), as routed_experts takes it.
        gate_fn: callable [n, 2I] -> [n, I] in x's dtype (any other gate rule).
        activation: elementwise callable for experts without a gate.
        activations: ``"weight_only"`` or ``"dynamic"`` (W8A8; block-FP8 stacks only).
        up_bias: optional [E, U] bias of the up projection, laid out like `up`'s rows (gpt-oss'
            interleaved [gate, up] pairs for its interleaved unit); with `gate_weight`, [E, 2I]
            for [gate | up] as the gate rule sees them.  Any floating dtype.
        down_bias: optional [E, O] bias of the down projection.  Any floating dtype.

    Returns:
        [T, O] in x's dtype.

    Raises:
        NotImplementedError: a call autograd would record, or stacks on another device than the CPU
            or a CUDA device.
        TypeError, ValueError: arguments that do not fit together, naming the argument (tensors on
            different devices; float64 tokens on CUDA).
    """
    keepable = gate_fn is None and activation is None and isinstance(gate, (str, GatedUnit)) and \
        activations in ACTIVATIONS
    check_routing(x, expert_ids, weights, WHERE)
    entry = _kept_checks(up, down, gate_weight, gate, activations, up_bias, down_bias) if keepable else None
    if entry is None:
        width = _check_experts(up, down, gate_weight, gate, gate_fn, activation, activations, up_bias, down_bias)
    else:
        width = entry.width
    _check_tokens(x, expert_ids, weights, up, width)
    unit = gate_unit_of(gate)
    experts = QuantizedExperts(up, down, gate_weight, unit, None if unit is not None else gate_fn, activation,
                               activations, up_bias, down_bias,
                               decode_form=entry.form if entry is not None else NOT_ASKED)
    if keepable and entry is None:
        _keep_checked(up, down, gate_weight, gate, activations, up_bias, down_bias, width, experts.decode_form())
    return run_quantized(x, expert_ids, weights, experts)


def run_quantized(x: torch.Tensor, expert_ids: torch.Tensor, weights: Optional[torch.Tensor],
                  experts: QuantizedExperts) -> torch.Tensor:
    """routed_quantized_experts on arguments its checks passed (transformers' "tutel" FP8 experts
    check a module's stacks once, when they first see them, and each call's own tensors; here the
    tokens' device and dtype against the stacks').  Returns [T, O] in x's dtype."""
    device = x.device
    if device != experts.up.device or expert_ids.device != device or \
            (device.type != "cpu" and x.dtype == torch.float64):
        require_same_device(device, experts.up.device, f"{WHERE}: the tokens")
        require_same_device(expert_ids.device, experts.up.device, f"{WHERE}: the expert ids")
        require_rows_dtype(x.dtype, device, f"{WHERE}: the tokens")
    facts = quantized_experts_facts(x, expert_ids, weights, experts)
    if facts["gradient"]:
        raise NotImplementedError(f"{WHERE}: quantized experts run inference only, but autograd records this call "
                                  f"(the tokens, the routing weights or the biases require grad); call the model "
                                  f"under torch.no_grad() or torch.inference_mode() (generate() does), or train on "
                                  f"dequantized experts")
    path = choose_path(EXPERTS, facts).path
    y = run(path, Work(x, experts, expert_ids=expert_ids, weights=weights)).y
    return y if y.dtype == x.dtype else y.to(x.dtype)  # (.to costs a dispatch even with nothing to do)
