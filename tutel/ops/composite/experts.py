"""The routed experts' operators as plain PyTorch operations: ``group_by_expert`` (the dropless
grouping of the choices by expert) and the gated units ``gated_unit`` / ``gated_unit_pair`` with
their backward passes, with the arguments and results of ``torch.ops.tutel``'s.

No host synchronisation: every size comes from the shapes and the integer arguments, so these
can be captured in a CUDA graph.  ``group_by_expert`` is bit for bit the CPU operator's; the
gated units compute the CPU operator's formula (csrc/core/gated_units.h) in the accumulation
dtype (float32 for 16-bit data) and round once, so they agree with it to the exponential's
rounding.  ``gated_unit``'s per-expert bias of rows grouped by expert (``bias``, ``offsets``) is
added in that dtype too, each row's expert found by ``torch.searchsorted`` over the ends.
"""
import math
from typing import Optional, Tuple

import torch


def group_by_expert(expert_ids: torch.Tensor, num_experts: int) -> Tuple[torch.Tensor, ...]:
    """The T*k choices of expert_ids [T, k] sorted by expert, stably in the order t*k + j; ids
    outside [0, num_experts) sort last.  Returns (locations [k, T] int32, T*k for a dropped
    choice; slot_choices [T*k] int64; sorted_ids [T*k] int64, num_experts for dropped; counts [E]
    int64; ends [E] int32), as tutel::group_by_expert.  A stable sort of the keys, a search of
    the sorted keys for the counts (deterministic, unlike an atomic histogram) and a scatter of
    the slot numbers."""
    where = "tutel::group_by_expert"
    if expert_ids.dim() != 2:
        raise ValueError(f"{where}: `expert_ids` must be [T, k], got {expert_ids.dim()} dims")
    if expert_ids.is_floating_point() or expert_ids.is_complex() or expert_ids.dtype == torch.bool:
        raise TypeError(f"{where}: `expert_ids` must hold integers, got {expert_ids.dtype}")
    if num_experts < 1:
        raise ValueError(f"{where}: `num_experts` must be >= 1, got {num_experts}")
    tokens, k = expert_ids.shape
    ids = expert_ids.reshape(-1).long()
    total = ids.numel()
    dropped = (ids < 0) | (ids >= num_experts)
    key = ids.masked_fill(dropped, num_experts)
    sorted_ids, slot_choices = torch.sort(key, stable=True)
    bucket_numbers = torch.arange(num_experts + 1, device=ids.device, dtype=torch.int64)
    bounds = torch.searchsorted(sorted_ids, bucket_numbers)  # where each bucket starts
    counts = bounds[1:] - bounds[:-1]
    slot = torch.empty(total, dtype=torch.int32, device=ids.device)
    slot.scatter_(0, slot_choices, torch.arange(total, dtype=torch.int32, device=ids.device))
    locations = slot.masked_fill_(dropped, total).view(tokens, k).t().contiguous()
    return locations, slot_choices, sorted_ids, counts, bounds[1:].to(torch.int32)


def _accumulation(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float64 if x.dtype == torch.float64 else torch.float32)


def _check_floating(x: torch.Tensor, name: str, where: str) -> None:
    if x.dtype not in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        raise TypeError(f"{where}: `{name}` must be float32, float64, bfloat16 or float16, got {x.dtype}")


def _check_gate_up(gate_up: torch.Tensor, where: str) -> None:
    if gate_up.dim() != 2:
        raise ValueError(f"{where}: `gate_up` must be 2-D, got shape {tuple(gate_up.shape)}")
    _check_floating(gate_up, "gate_up", where)
    if gate_up.shape[1] % 2:
        raise ValueError(f"{where}: `gate_up` must have an even number of columns (gate and up values), "
                         f"got {gate_up.shape[1]}")


def _check_pair(gate: torch.Tensor, up: torch.Tensor, where: str) -> None:
    if gate.dim() != 2:
        raise ValueError(f"{where}: `gate` must be 2-D, got shape {tuple(gate.shape)}")
    _check_floating(gate, "gate", where)
    if up.dtype != gate.dtype or up.shape != gate.shape or up.device != gate.device:
        raise ValueError(f"{where}: `up` must have the shape, dtype and device of `gate`")


def _check_grouped_bias(gate_up: torch.Tensor, bias: Optional[torch.Tensor], offsets: Optional[torch.Tensor],
                        where: str) -> None:
    """The checks of csrc/ops/gated_unit_args.cpp's checked_grouped_bias (offsets' order unchecked)."""
    if (bias is None) != (offsets is None):
        given = "`bias` without `offsets`" if offsets is None else "`offsets` without `bias`"
        raise ValueError(f"{where}: `bias` and `offsets` must be given together, got {given}")
    if bias is None:
        return
    if bias.dim() != 2:
        raise ValueError(f"{where}: `bias` must be 2-D, got shape {tuple(bias.shape)}")
    if bias.dtype != gate_up.dtype:
        raise TypeError(f"{where}: `bias` must have dtype {gate_up.dtype}, got {bias.dtype}")
    if bias.device != gate_up.device:
        raise ValueError(f"{where}: `bias` is on {bias.device} but the data is on {gate_up.device}")
    if bias.shape[1] != gate_up.shape[1]:
        raise ValueError(f"{where}: `bias` must have shape [experts, {gate_up.shape[1]}] (a row of `gate_up`), "
                         f"got {tuple(bias.shape)}")
    check_offsets(offsets, gate_up, where)
    if offsets.shape[0] != bias.shape[0]:
        raise ValueError(f"{where}: `offsets` must have one end per expert ([{bias.shape[0]}], the rows of "
                         f"`bias`), got {tuple(offsets.shape)}")


def check_offsets(offsets: torch.Tensor, data: torch.Tensor, where: str) -> None:
    """ValueError / TypeError (from `where`) unless `offsets` is a 1-D int32 tensor on `data`'s
    device (the group ends of rows grouped by expert; their values are not read)."""
    if offsets.dim() != 1:
        raise ValueError(f"{where}: `offsets` must be 1-D, got shape {tuple(offsets.shape)}")
    if offsets.dtype != torch.int32:
        raise TypeError(f"{where}: `offsets` must have dtype torch.int32, got {offsets.dtype}")
    if offsets.device != data.device:
        raise ValueError(f"{where}: `offsets` is on {offsets.device} but the data is on {data.device}")


def row_experts(rows: int, offsets: torch.Tensor) -> torch.Tensor:
    """[rows] int64: each grouped row's expert, the first e with offsets[e] > row (len(offsets)
    past the last expert's rows); offsets [E] int32, non-decreasing."""
    if rows < 2 ** 31:  # searched as int32, saving a conversion of the ends
        return torch.searchsorted(offsets, torch.arange(rows, dtype=offsets.dtype, device=offsets.device),
                                  right=True)
    positions = torch.arange(rows, dtype=torch.int64, device=offsets.device)
    return torch.searchsorted(offsets.to(torch.int64), positions, right=True)


def add_grouped_bias(gate_up: torch.Tensor, bias: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """gate_up [n, 2I] plus each row's expert bias, in the accumulation dtype (no rounding to
    gate_up's dtype in between); rows past the last expert's rows unchanged.  Differentiable in
    both."""
    values = _accumulation(gate_up)
    experts = bias.shape[0]
    if experts == 0:
        return values
    expert = row_experts(gate_up.shape[0], offsets)
    picked = _accumulation(bias).index_select(0, expert.clamp(max=experts - 1))
    return torch.where((expert < experts).unsqueeze(1), values + picked, values)


def _split(gate_up: torch.Tensor, interleaved: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    if interleaved:
        return gate_up[:, 0::2], gate_up[:, 1::2]
    return gate_up.chunk(2, dim=1)


def _check_unit(alpha: float, up_offset: float, limit: Optional[float], where: str) -> None:
    if not (math.isfinite(alpha) and math.isfinite(up_offset)):
        raise ValueError(f"{where}: `alpha` and `up_offset` must be finite, got {alpha} and {up_offset}")
    if limit is not None and not (math.isfinite(limit) and limit > 0):
        raise ValueError(f"{where}: `limit` must be None or a finite number > 0, got {limit}")


def _clamped(gate: torch.Tensor, up: torch.Tensor, limit: Optional[float]):
    """(g', u') in the accumulation dtype; NaN stays NaN, as in torch.clamp."""
    g, u = _accumulation(gate), _accumulation(up)
    if limit is not None:
        g, u = g.clamp(max=limit), u.clamp(min=-limit, max=limit)
    return g, u


def _forward(gate, up, alpha, up_offset, limit, dtype=None):
    """h in `dtype` (default: the gates')."""
    g, u = _clamped(gate, up, limit)
    s = 1 / (1 + torch.exp(-alpha * g))
    return ((u + up_offset) * (g * s)).to(gate.dtype if dtype is None else dtype)


def _backward(grad, gate, up, alpha, up_offset, limit, dtype=None):
    """(d gate, d up) in `dtype` (default: the gates'), each passing only inside the closed
    clamp bounds."""
    g, u = _clamped(gate, up, limit)
    dh = _accumulation(grad)
    s = 1 / (1 + torch.exp(-alpha * g))
    dg = dh * (u + up_offset) * (s * (1 + alpha * g * (1 - s)))
    du = dh * (g * s)
    if limit is not None:
        g_in, u_in = _accumulation(gate), _accumulation(up)
        dg = torch.where(g_in <= limit, dg, torch.zeros_like(dg))
        du = torch.where((u_in >= -limit) & (u_in <= limit), du, torch.zeros_like(du))
    dtype = gate.dtype if dtype is None else dtype
    return dg.to(dtype), du.to(dtype)


def _biased(gate_up: torch.Tensor, bias: Optional[torch.Tensor], offsets: Optional[torch.Tensor]) -> torch.Tensor:
    return gate_up if bias is None else add_grouped_bias(gate_up, bias, offsets)


def gated_unit(gate_up: torch.Tensor, alpha: float, up_offset: float, limit: Optional[float],
               interleaved: bool, bias: Optional[torch.Tensor] = None,
               offsets: Optional[torch.Tensor] = None) -> torch.Tensor:
    """h [n, I] = (u' + up_offset) * g' * sigmoid(alpha g') of gate_up [n, 2I] (plus each row's
    expert bias when bias [E, 2I] and offsets [E] int32 are given), as tutel::gated_unit."""
    where = "tutel::gated_unit"
    _check_unit(alpha, up_offset, limit, where)
    _check_gate_up(gate_up, where)
    _check_grouped_bias(gate_up, bias, offsets, where)
    values = _biased(gate_up, bias, offsets)
    return _forward(*_split(values, interleaved), alpha, up_offset, limit, gate_up.dtype)


def gated_unit_backward(grad: torch.Tensor, gate_up: torch.Tensor, alpha: float, up_offset: float,
                        limit: Optional[float], interleaved: bool, bias: Optional[torch.Tensor] = None,
                        offsets: Optional[torch.Tensor] = None) -> torch.Tensor:
    """d gate_up [n, 2I] (gate_up's layout) from d h [n, I], at the biased values when bias and
    offsets are given, as tutel::gated_unit_backward."""
    where = "tutel::gated_unit_backward"
    _check_unit(alpha, up_offset, limit, where)
    _check_gate_up(gate_up, where)
    if grad.shape != (gate_up.shape[0], gate_up.shape[1] // 2) or grad.dtype != gate_up.dtype:
        raise ValueError(f"{where}: `grad` must have shape [{gate_up.shape[0]}, {gate_up.shape[1] // 2}] and "
                         f"dtype {gate_up.dtype}, got {tuple(grad.shape)} {grad.dtype}")
    _check_grouped_bias(gate_up, bias, offsets, where)
    values = _biased(gate_up, bias, offsets)
    dg, du = _backward(grad, *_split(values, interleaved), alpha, up_offset, limit, gate_up.dtype)
    if interleaved:
        return torch.stack((dg, du), dim=2).view(gate_up.shape)
    return torch.cat((dg, du), dim=1)


def gated_unit_pair(gate: torch.Tensor, up: torch.Tensor, alpha: float, up_offset: float,
                    limit: Optional[float]) -> torch.Tensor:
    """The gated unit over gates and ups in two [n, I] tensors, as tutel::gated_unit_pair."""
    where = "tutel::gated_unit_pair"
    _check_unit(alpha, up_offset, limit, where)
    _check_pair(gate, up, where)
    return _forward(gate, up, alpha, up_offset, limit)


def gated_unit_pair_backward(grad: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, alpha: float,
                             up_offset: float, limit: Optional[float]) -> Tuple[torch.Tensor, torch.Tensor]:
    """(d gate, d up) from d h, as tutel::gated_unit_pair_backward."""
    where = "tutel::gated_unit_pair_backward"
    _check_unit(alpha, up_offset, limit, where)
    _check_pair(gate, up, where)
    if grad.shape != gate.shape or grad.dtype != gate.dtype:
        raise ValueError(f"{where}: `grad` must have shape {list(gate.shape)} and dtype {gate.dtype}, got "
                         f"{tuple(grad.shape)} {grad.dtype}")
    return _backward(grad, gate, up, alpha, up_offset, limit)
