"""Routed gated experts at decoding sizes, for inference: tutel's ``decode_experts`` operator.

``decode_experts(x, expert_ids, weights, up_weight, down_weight, ...)`` is the weighted sum of
each token's routed gated experts,

    out[t] = sum_j weights[t, j] * (unit(x[t] @ W_up[e]^T + b_up[e]) @ W_down[e]^T + b_down[e]),
    e = expert_ids[t, j],

over the choices j whose id lies in [0, E): an id outside that range contributes nothing, as in
``tutel.experts.routed.routed_experts``.  ``unit`` is a ``tutel.ops.gated_units.GatedUnit``:
SwiGLU (silu(g) * u), or gpt-oss' clamped unit over interleaved gate and up values with biases.
The result is ``routed_gated_experts``' (the grouped path of ``routed_experts``) to rounding.

On CUDA it is two launches of kernels/decode_experts.cu with no host synchronisation (CUDA-graph
capturable): each chosen expert's matrices are read once for all the tokens that chose it, the
gated unit is applied in registers and each token's output is written once, summed over its
choices in choice order (no float atomics: the same result from run to run).  It is made for 1
to 32 tokens, where a grouped product wastes most of its tiles; ``decode_experts_supported``
says where a caller should pick it.  On CPU it is ``routed_gated_experts`` itself.  Where the
kernels fail the first-use self-check on a device (tutel.ops.backend), ``decode_experts`` runs the
composite operator (tutel.ops.composite.decode_experts) there and ``decode_experts_supported`` says
False, so the layer's paths take the grouped path instead.

The operator has no backward: it is for inference (``torch.no_grad()`` /
``torch.inference_mode()``).  Train with ``tutel.experts.routed.routed_experts``.
"""
from typing import Optional, Union

import torch

from .extension import load_extension
from ..rules.lines import DECODE_MAX_CHOICES, DECODE_MAX_TOKENS  # the kernel's limits, why: tutel/rules/lines.py
from .backend import fake_mode_active, operators_for, requested_backend
from .checks import FLOATING_DTYPES, require_dim, require_floating, require_tensor, same_device
from .decode_lines import within_line
from .gated_units import SWIGLU, GatedUnit, check_unit, unit_scalars

# Expert id dtypes the kernel reads as they are (another dtype would need a conversion launch).
EXPERT_ID_DTYPES = (torch.int32, torch.int64)


def decode_experts_supported(tokens: int, k: int, dtype: torch.dtype,
                             device: Union[str, torch.device] = "cuda", experts: Optional[int] = None) -> bool:
    """Whether ``decode_experts``' CUDA kernel applies to a call of `tokens` tokens with `k`
    choices each over `experts` experts and data of `dtype` on `device`, so that a caller can
    choose it over the grouped path (``tutel.experts.routed.routed_experts``).

    True when all of these hold:

    * `device` is a CUDA device (on CPU the operator is the grouped path itself: no gain);
    * `dtype` is float32, float64, bfloat16 or float16;
    * 0 <= tokens <= DECODE_MAX_TOKENS (32) and tokens * k <= DECODE_MAX_CHOICES (256), the sizes
      the kernel is made for;
    * tokens * k / experts is within the line measured for this GPU (its compute capability) and
      `dtype`, where one was (``tutel.ops.decode_lines``; not applied when `experts` is None);
    * tutel was built with CUDA (or a FakeTensorMode is active, where fake CUDA tensors take the
      path of a CUDA build), ``TUTEL_CUDA_BACKEND`` is not ``composite`` and the kernels passed the
      first-use self-check on the device (tutel.ops.backend).

    Every matrix layout the operator takes is handled by the kernel: the ``F.linear`` layout and
    the transposed one, concatenated, interleaved or separate gates, with or without biases, any
    hidden / intermediate / output size (16-byte loads where sizes and alignment allow, element
    loads otherwise), int32 or int64 expert ids and weights of any floating dtype, any strides.
    So the layout is not an argument here.
    """
    device = torch.device(device)
    if device.type != "cuda" or dtype not in FLOATING_DTYPES:
        return False
    if not (0 <= tokens <= DECODE_MAX_TOKENS and k >= 0 and tokens * k <= DECODE_MAX_CHOICES):
        return False
    if requested_backend() == "composite":  # the user asked for no tutel kernels on CUDA
        return False
    if not (fake_mode_active() or load_extension().with_cuda):
        return False
    if not _kernel_chosen(device):
        return False
    return within_line(tokens, k, experts, dtype, device)


def _kernel_chosen(device: torch.device) -> bool:
    """Whether tutel.ops.backend uses the decode_experts kernels on `device` (False where they
    failed the first-use self-check; a device without an index is the current one)."""
    if device.index is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    return operators_for(device).decode_experts is torch.ops.tutel.decode_experts


def _check_routing(x: torch.Tensor, expert_ids: torch.Tensor, weights: Optional[torch.Tensor], where: str) -> None:
    require_tensor(expert_ids, "expert_ids", where)
    if expert_ids.dtype not in EXPERT_ID_DTYPES:
        raise TypeError(f"{where}: `expert_ids` must be int32 or int64, got {expert_ids.dtype}")
    if expert_ids.dim() != 2 or expert_ids.shape[0] != x.shape[0]:
        raise ValueError(f"{where}: `expert_ids` must be [T, k] with T = {x.shape[0]} rows of `x`, got shape "
                         f"{tuple(expert_ids.shape)}")
    same_device(x, expert_ids, "expert_ids", where)
    if weights is not None:
        require_floating(weights, "weights", where)
        if weights.shape != expert_ids.shape:
            raise ValueError(f"{where}: `weights` must have the shape of `expert_ids` {tuple(expert_ids.shape)}, "
                             f"got {tuple(weights.shape)}")
        same_device(x, weights, "weights", where)


def _check_matrices(x: torch.Tensor, where: str, **tensors: Optional[torch.Tensor]) -> None:
    """Every expert tensor given is in x's dtype and on x's device (the operator checks the shapes)."""
    for name, t in tensors.items():
        if t is None:
            continue
        require_tensor(t, name, where)
        if t.dtype != x.dtype:
            raise TypeError(f"{where}: `{name}` must have x's dtype {x.dtype}, got {t.dtype}")
        same_device(x, t, name, where)


def decode_experts(x: torch.Tensor, expert_ids: torch.Tensor, weights: Optional[torch.Tensor],
                   up_weight: torch.Tensor, down_weight: torch.Tensor, *,
                   up_bias: Optional[torch.Tensor] = None, down_bias: Optional[torch.Tensor] = None,
                   transposed: bool = False, unit: GatedUnit = SWIGLU,
                   gate_weight: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The weighted sum of each token's routed gated experts, for inference (see the module
    docstring for the formula).

    Args:
        x: [T, H] token rows (float32, float64, bfloat16 or float16).
        expert_ids: [T, k] int32 or int64 expert ids; an id outside [0, E) is a dropped choice
            (contributes nothing).  A token may name an expert more than once.
        weights: [T, k] routing weights of any floating dtype, or None for weight 1.
        up_weight: [E, 2I, H] gate and up rows (the ``F.linear`` layout), or [E, H, 2I] when
            `transposed`: gates then ups, or alternating gate, up when ``unit.interleaved``.
            With `gate_weight`, [E, I, H] (or [E, H, I]) ups only.  In x's dtype.
        down_weight: [E, O, I], or [E, I, O] when `transposed`; in x's dtype.
        up_bias: [E, 2I] bias of the up projection (up_weight's order of gates and ups), or None.
        down_bias: [E, O] bias of the down projection, or None.
        transposed: the matrices are [E, in, out] (``x @ W``) instead of [E, out, in].
        unit: the gated unit (``SWIGLU``, or e.g. gpt-oss'
            ``GatedUnit(1.702, 1.0, 7.0, interleaved=True)``).
        gate_weight: the gates' own matrices (up_weight's shape), or None; then the unit is not
            interleaved and there is no `up_bias`.

    Returns:
        [T, O] in x's dtype, on x's device.  Tokens without a kept choice give zeros.

    Raises:
        TypeError / ValueError: for a tensor of the wrong dtype, shape or device, naming it.
        RuntimeError: where a gradient would be needed (grad mode is on and an input requires
            one): the operator has no backward; use ``tutel.experts.routed.routed_experts`` to
            train.
    """
    where = "tutel.ops.decode_experts"
    require_floating(x, "x", where)
    require_dim(x, 2, "x", where)
    _check_routing(x, expert_ids, weights, where)
    _check_matrices(x, where, up_weight=up_weight, down_weight=down_weight, up_bias=up_bias, down_bias=down_bias,
                    gate_weight=gate_weight)
    if not isinstance(unit, GatedUnit):
        raise TypeError(f"{where}: `unit` must be a tutel.ops.gated_units.GatedUnit, got {type(unit).__name__}")
    check_unit(unit, where)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                       for t in (x, weights, up_weight, down_weight, up_bias, down_bias, gate_weight)):
        raise RuntimeError(f"{where} is for inference and has no backward, but an input requires a gradient: call "
                           "it under torch.no_grad() or torch.inference_mode(), or train with "
                           "tutel.experts.routed.routed_experts")
    decode = operators_for(x.device).decode_experts
    if decode is not torch.ops.tutel.decode_experts:
        # The composite operator, where the CUDA kernels failed tutel.ops.backend's self-check.
        return decode(x, expert_ids, weights, up_weight, down_weight, up_bias, down_bias, bool(transposed),
                      *unit_scalars(unit), bool(unit.interleaved), gate_weight)
    return decode_experts_planned(x, expert_ids, weights, up_weight, down_weight, up_bias, down_bias, transposed,
                                  unit, gate_weight)


def decode_experts_planned(x: torch.Tensor, expert_ids: torch.Tensor, weights: Optional[torch.Tensor],
                           up_weight: torch.Tensor, down_weight: torch.Tensor, up_bias: Optional[torch.Tensor],
                           down_bias: Optional[torch.Tensor], transposed: bool, unit: GatedUnit,
                           gate_weight: Optional[torch.Tensor]) -> torch.Tensor:
    """decode_experts for the tensors of tutel's routed experts and layer, which their own checks
    passed (the operator checks the shapes itself): no checks here, where they would cost more
    Python than the rest of a decoding step's call.  The biases are taken in x's dtype.  The paths
    call it only where decode_experts_supported holds, that is where the kernels passed the
    self-check, so it calls the compiled operator."""
    if up_bias is not None and up_bias.dtype != x.dtype:
        up_bias = up_bias.to(x.dtype)
    if down_bias is not None and down_bias.dtype != x.dtype:
        down_bias = down_bias.to(x.dtype)
    return torch.ops.tutel.decode_experts(x, expert_ids, weights, up_weight, down_weight, up_bias, down_bias,
                                          bool(transposed), *unit_scalars(unit), bool(unit.interleaved), gate_weight)