"""The experts' gated activation of their up projection, fused on CPU.

``gated_unit(gate_up, unit)`` maps the [..., 2I] up projection (gate and up values, concatenated
or alternating) to the [..., I] hidden values

    h = (u' + up_offset) * g' * sigmoid(alpha * g'),   g' = min(g, limit),  u' = clamp(u, -limit, limit)

(no clamping when ``limit`` is None).  ``SWIGLU`` (alpha 1, no offset, no limit) is
silu(g) * u, the rule of LLaMA, Mixtral, Qwen-MoE and DeepSeek; ``GatedUnit(1.702, 1.0, 7.0,
interleaved=True)`` is gpt-oss'.

Experts with biases on their up projection (gpt-oss) pass ``bias`` [E, 2I] and ``offsets`` [E]
(int32, the non-decreasing end of each expert's rows when the rows are grouped by expert, as
``group_by_expert``'s ``ends``): each row's gate and up values then take its expert's bias
first, added in the accumulation dtype (float32 for 16-bit data) without rounding in between,
in the same launch on CUDA.  The bias' gradient is the per-expert sum of d gate_up.

``gated_unit_pair(gate, up, unit)`` is the same unit over gates and ups held in two tensors
(experts whose gate and up projections are separate products, as Tutel's ``llama_ffn``).

On CPU and CUDA forward and backward are one pass each of tutel's ``gated_unit`` operator (one
kernel launch each on CUDA, kernels/gated_units.cu); composed from
PyTorch operators they are five to twelve passes over [n, I] temporaries (gpt-oss' backward
also fills two [n, 2I] buffers with zeros for its strided halves), which cost a fifth of a
gpt-oss training step at 2048 tokens (benchmarks/transformers_moe.py).  Other devices (and CUDA
with TUTEL_CUDA_BACKEND=composite) run the composition of PyTorch operators, which is also the
reference the tests hold the operator to.
"""
import math
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F

from .backend import operators_for
from .checks import require_floating, require_tensor
from .composite.experts import add_grouped_bias
from .tracing import eager_without_grad

class GatedUnit(NamedTuple):
    """The parameters of a gated unit (see the module docstring)."""
    alpha: float = 1.0  # the sigmoid's slope: g * sigmoid(alpha * g)
    up_offset: float = 0.0  # added to the (clamped) up value
    limit: Optional[float] = None  # clamp bound, None for no clamping
    interleaved: bool = False  # gate and up values alternate instead of being the two halves


SWIGLU = GatedUnit()


def split_gate_up(gate_up: torch.Tensor, interleaved: bool):
    """(gate, up) views of the [..., 2I] up projection."""
    if interleaved:
        return gate_up[..., 0::2], gate_up[..., 1::2]
    return gate_up.chunk(2, dim=-1)


def gated_unit_composite(gate_up: torch.Tensor, unit: GatedUnit, *, bias: Optional[torch.Tensor] = None,
                         offsets: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The gated unit composed from PyTorch operators (any device, autograd by PyTorch); with
    `bias` and `offsets`, of the biased values in the accumulation dtype, rounded once."""
    if bias is None:
        return _composite(*split_gate_up(gate_up, unit.interleaved), unit)
    rows = gate_up.reshape(-1, gate_up.shape[-1])
    hidden = _composite(*split_gate_up(add_grouped_bias(rows, bias, offsets), unit.interleaved), unit)
    return hidden.to(gate_up.dtype).view(*gate_up.shape[:-1], gate_up.shape[-1] // 2)


def _composite(gate: torch.Tensor, up: torch.Tensor, unit: GatedUnit) -> torch.Tensor:
    if unit.alpha == 1 and unit.up_offset == 0 and unit.limit is None:
        return F.silu(gate) * up
    if unit.limit is not None:
        gate = gate.clamp(max=unit.limit)
        up = up.clamp(min=-unit.limit, max=unit.limit)
    if unit.up_offset != 0:
        up = up + unit.up_offset
    return up * (gate * torch.sigmoid(unit.alpha * gate))


def gated_unit(gate_up: torch.Tensor, unit: GatedUnit = SWIGLU, *, bias: Optional[torch.Tensor] = None,
               offsets: Optional[torch.Tensor] = None) -> torch.Tensor:
    """[..., 2I] gate and up values -> [..., I] hidden values (see the module docstring).

    Args:
        gate_up: the up projection, [..., 2I] floating point.
        unit: the gated unit's parameters.
        bias: optional [E, 2I] per-expert bias of gate_up's dtype and device, laid out like a
            row of gate_up; given with `offsets`.
        offsets: optional [E] int32 on gate_up's device: the non-decreasing end of each
            expert's rows of gate_up's rows (leading dims flattened), grouped by expert.  Row r
            takes the bias of the first e with offsets[e] > r; rows past offsets[E - 1] take none.
            The order is not checked (that would synchronise with the device).

    Returns:
        h [..., I] in gate_up's dtype; differentiable in `gate_up` and `bias`.
    """
    where = "tutel.ops.gated_units.gated_unit"
    require_floating(gate_up, "gate_up", where)
    if gate_up.dim() == 0 or gate_up.shape[-1] % 2:
        raise ValueError(f"{where}: the last dim of `gate_up` {tuple(gate_up.shape)} must be even "
                         f"(gate and up values)")
    check_unit(unit, where)
    _check_grouped_bias(gate_up, bias, offsets, where)
    return apply_gated_unit(gate_up, unit, bias, offsets)


def apply_gated_unit(gate_up: torch.Tensor, unit: GatedUnit, bias: Optional[torch.Tensor] = None,
                     offsets: Optional[torch.Tensor] = None, eager: Optional[bool] = None) -> torch.Tensor:
    """gated_unit for arguments checked already (experts check their unit when they are built, and
    the paths make gate_up, bias and offsets themselves).  `eager`: whether nothing records or
    traces the call (``eager_without_grad`` of gate_up and bias, which a caller may have asked
    already), None to ask here."""
    # (fused_unit_on and unit_scalars written out: this runs in every gated experts call)
    if operators_for(gate_up.device).gated_unit is not torch.ops.tutel.gated_unit:
        return gated_unit_composite(gate_up, unit, bias=bias, offsets=offsets)
    rows = gate_up.reshape(-1, gate_up.shape[-1])
    limit = None if unit.limit is None else float(unit.limit)
    args = (float(unit.alpha), float(unit.up_offset), limit, bool(unit.interleaved))
    if eager_without_grad(gate_up, bias) if eager is None else eager:
        # Nothing to trace or differentiate: skip the custom operator's dispatch.
        hidden = torch.ops.tutel.gated_unit(rows, *args, bias, offsets)
    else:
        hidden = _gated_unit(rows, *args, bias, offsets)
    return hidden.view(*gate_up.shape[:-1], gate_up.shape[-1] // 2)


def _check_grouped_bias(gate_up: torch.Tensor, bias: Optional[torch.Tensor], offsets: Optional[torch.Tensor],
                        where: str) -> None:
    """TypeError / ValueError (from `where`, naming the argument) unless bias and offsets are both
    None or a [E, 2I] bias of gate_up's dtype and device and [E] int32 offsets on that device."""
    if (bias is None) != (offsets is None):
        given, missing = ("bias", "offsets") if offsets is None else ("offsets", "bias")
        raise ValueError(f"{where}: `{given}` needs `{missing}`: the per-expert bias takes both or neither")
    if bias is None:
        return
    require_floating(bias, "bias", where)
    require_tensor(offsets, "offsets", where)
    if bias.dim() != 2 or bias.shape[1] != gate_up.shape[-1]:
        raise ValueError(f"{where}: `bias` must be [experts, {gate_up.shape[-1]}] (a row of `gate_up`), got "
                         f"shape {tuple(bias.shape)}")
    if bias.dtype != gate_up.dtype:
        raise TypeError(f"{where}: `bias` must have the dtype of `gate_up` ({gate_up.dtype}), got {bias.dtype}")
    if offsets.dtype != torch.int32:
        raise TypeError(f"{where}: `offsets` must be int32 (each expert's end row), got {offsets.dtype}")
    if offsets.shape != bias.shape[:1]:
        raise ValueError(f"{where}: `offsets` must be [{bias.shape[0]}] (one end per row of `bias`), got shape "
                         f"{tuple(offsets.shape)}")
    for name, value in (("bias", bias), ("offsets", offsets)):
        if value.device != gate_up.device:
            raise ValueError(f"{where}: `{name}` is on {value.device} but `gate_up` is on {gate_up.device}")


def fused_unit_on(device: torch.device, operator: str = "gated_unit") -> bool:
    """Whether tutel's `operator` (gated_unit or gated_unit_pair, with its backward) runs on
    `device`: on CPU always, on CUDA where the kernels were chosen (tutel.ops.backend: fake CUDA
    tensors take them too), elsewhere never."""
    return getattr(operators_for(device), operator) is getattr(torch.ops.tutel, operator)


def check_unit(unit: GatedUnit, where: str) -> None:
    """ValueError (from `where`) unless the unit's parameters are finite and its limit None or > 0."""
    if not (math.isfinite(unit.alpha) and math.isfinite(unit.up_offset)) or \
            (unit.limit is not None and not (math.isfinite(unit.limit) and unit.limit > 0)):
        raise ValueError(f"{where}: {unit} is not allowed: alpha and up_offset must be finite, limit None or a "
                         f"finite number > 0")


def unit_scalars(unit: GatedUnit) -> tuple:
    """(alpha, up_offset, limit) as the operators take them."""
    return float(unit.alpha), float(unit.up_offset), None if unit.limit is None else float(unit.limit)


@torch.library.custom_op("tutel::gated_unit_rows", mutates_args=())
def _gated_unit(gate_up: torch.Tensor, alpha: float, up_offset: float, limit: Optional[float],
                interleaved: bool, bias: Optional[torch.Tensor] = None,
                offsets: Optional[torch.Tensor] = None) -> torch.Tensor:
    return torch.ops.tutel.gated_unit(gate_up, alpha, up_offset, limit, interleaved, bias, offsets)


@_gated_unit.register_fake
def _gated_unit_fake(gate_up, alpha, up_offset, limit, interleaved, bias=None, offsets=None):
    return gate_up.new_empty((gate_up.shape[0], gate_up.shape[1] // 2))


def _setup_context(ctx, inputs, output):
    gate_up, alpha, up_offset, limit, interleaved, bias, offsets = inputs
    ctx.save_for_backward(gate_up, bias, offsets)
    ctx.unit = (alpha, up_offset, limit, interleaved)


def _backward(ctx, grad):
    gate_up, bias, offsets = ctx.saved_tensors
    grad_gate_up = torch.ops.tutel.gated_unit_backward(grad, gate_up, *ctx.unit, bias, offsets)
    grad_bias = None
    if bias is not None and ctx.needs_input_grad[5]:
        # The per-expert sums of d gate_up (float32 accumulation), one launch on CUDA.
        grad_bias = operators_for(grad_gate_up.device).expert_row_sums(grad_gate_up, offsets)
    return grad_gate_up, None, None, None, None, grad_bias, None


_gated_unit.register_autograd(_backward, setup_context=_setup_context)


def gated_unit_pair(gate: torch.Tensor, up: torch.Tensor, unit: GatedUnit = SWIGLU) -> torch.Tensor:
    """The gated unit over gates and ups held in two tensors of the same shape [..., I] (experts
    whose gate and up projections are separate products, as Tutel's ``llama_ffn``) -> [..., I];
    differentiable in both.  `unit` must not be interleaved."""
    where = "tutel.ops.gated_units.gated_unit_pair"
    require_floating(gate, "gate", where)
    if not isinstance(up, torch.Tensor) or up.shape != gate.shape or up.dtype != gate.dtype or \
            up.device != gate.device:
        raise ValueError(f"{where}: `up` must be a tensor of the shape, dtype and device of `gate` "
                         f"({tuple(gate.shape)}, {gate.dtype}, {gate.device}), got "
                         f"{(tuple(up.shape), up.dtype, up.device) if isinstance(up, torch.Tensor) else type(up)}")
    if unit.interleaved:
        raise ValueError(f"{where}: {unit} is interleaved; separate gates and ups take interleaved=False")
    check_unit(unit, where)
    return apply_gated_unit_pair(gate, up, unit)


def apply_gated_unit_pair(gate: torch.Tensor, up: torch.Tensor, unit: GatedUnit) -> torch.Tensor:
    """gated_unit_pair for arguments checked already (tutel's experts pass their own products and
    a fixed, valid unit)."""
    if gate.dim() == 0 or not fused_unit_on(gate.device, "gated_unit_pair"):
        return _composite(gate, up, unit)
    gate_rows, up_rows = gate.reshape(-1, gate.shape[-1]), up.reshape(-1, up.shape[-1])
    if eager_without_grad(gate, up):
        hidden = torch.ops.tutel.gated_unit_pair(gate_rows, up_rows, *unit_scalars(unit))
    else:
        hidden = _gated_unit_pair(gate_rows, up_rows, *unit_scalars(unit))
    return hidden.view(gate.shape)


@torch.library.custom_op("tutel::gated_unit_pair_rows", mutates_args=())
def _gated_unit_pair(gate: torch.Tensor, up: torch.Tensor, alpha: float, up_offset: float,
                     limit: Optional[float]) -> torch.Tensor:
    return torch.ops.tutel.gated_unit_pair(gate, up, alpha, up_offset, limit)


@_gated_unit_pair.register_fake
def _gated_unit_pair_fake(gate, up, alpha, up_offset, limit):
    return gate.new_empty(gate.shape)


def _pair_setup_context(ctx, inputs, output):
    gate, up, alpha, up_offset, limit = inputs
    ctx.save_for_backward(gate, up)
    ctx.unit = (alpha, up_offset, limit)


def _pair_backward(ctx, grad):
    gate, up = ctx.saved_tensors
    grad_gate, grad_up = torch.ops.tutel.gated_unit_pair_backward(grad, gate, up, *ctx.unit)
    return grad_gate, grad_up, None, None, None


_gated_unit_pair.register_autograd(_pair_backward, setup_context=_pair_setup_context)
