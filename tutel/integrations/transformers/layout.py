"""What a transformers experts module looks like, read from the flags its class declares.

transformers' ``@use_experts_implementation(...)`` decorator stores the layout of an experts
module on each instance: ``has_gate``, ``has_bias``, ``is_transposed``, ``is_concatenated``,
``has_post_expert_norm`` and the expert-parallel marker ``_is_expert_parallel``; a class may
also replace the gate rule by defining ``_apply_gate``.  ``read_layout`` checks a module against
those flags (the flag, the tensors it implies and their shapes) and raises
``UnsupportedExpertsLayout``, naming the module class and the flag, for anything the tutel
experts cannot run exactly.

Only shapes and Python attributes are read, so under ``torch.compile`` the checks are settled
at trace time and cost nothing afterwards.
"""
import math
from typing import Callable, NamedTuple, Optional, Union

import torch
from transformers.activations import SiLUActivation
from transformers.integrations.moe import _default_apply_gate

from ...ops.gated_units import GatedUnit

# The flags the decorator sets, in the order they are checked.
FLAGS = ("has_gate", "has_bias", "is_transposed", "is_concatenated", "has_post_expert_norm", "_is_expert_parallel")


class UnsupportedExpertsLayout(ValueError):
    """An experts module whose layout the "tutel" experts implementation cannot run."""

    def __init__(self, module: torch.nn.Module, flag: str, problem: str):
        self.module_class = type(module).__name__
        self.flag = flag
        super().__init__(f'experts_implementation="tutel": {self.module_class} ({flag}): {problem}')


class ExpertsLayout(NamedTuple):
    """The tensors and rules of one experts module, ready for ``tutel.experts.routed_experts``."""
    up_weight: torch.Tensor  # gate_up_proj (gated) or up_proj
    down_weight: torch.Tensor
    up_bias: Optional[torch.Tensor]
    down_bias: Optional[torch.Tensor]
    transposed: bool
    # "swiglu" when the module's gate is exactly silu(first half) * second half; a GatedUnit for
    # gpt-oss' own clamped interleaved gate; None otherwise (gate_fn runs)
    gate: Union[None, str, GatedUnit]
    gate_fn: Optional[Callable[[torch.Tensor], torch.Tensor]]
    activation: Optional[Callable[[torch.Tensor], torch.Tensor]]
    post_fn: Optional[Callable[[torch.Tensor], torch.Tensor]]
    num_experts: int
    expert_parallel: bool


def _flag(module: torch.nn.Module, name: str) -> bool:
    if not hasattr(module, name):
        raise UnsupportedExpertsLayout(
            module, name, "the flag is not set; is the class decorated with "
            "transformers.integrations.moe.use_experts_implementation?")
    value = getattr(module, name)
    if not isinstance(value, bool):
        raise UnsupportedExpertsLayout(module, name, f"must be True or False, got {value!r}")
    return value


def _weight(module: torch.nn.Module, name: str, flag: str, dims: int) -> torch.Tensor:
    tensor = getattr(module, name, None)
    if not isinstance(tensor, torch.Tensor):
        raise UnsupportedExpertsLayout(module, flag,
                                       f"expects a tensor `{name}`, the module has {type(tensor).__name__}")
    if tensor.dim() != dims:
        raise UnsupportedExpertsLayout(module, flag, f"`{name}` must have {dims} dimensions, got shape "
                                                     f"{tuple(tensor.shape)}")
    if not tensor.dtype.is_floating_point:
        raise UnsupportedExpertsLayout(module, flag, f"`{name}` must be floating point, got {tensor.dtype} "
                                                     "(quantised experts have their own implementations)")
    return tensor


def _callable(module: torch.nn.Module, name: str, flag: str) -> Callable[[torch.Tensor], torch.Tensor]:
    function = getattr(module, name, None)
    if not callable(function):
        raise UnsupportedExpertsLayout(module, flag, f"needs a callable `{name}`, the module has "
                                                     f"{type(function).__name__}")
    return function


def _is_silu(function: Callable) -> bool:
    """Whether `function` is known to compute x * sigmoid(x) exactly as F.silu does."""
    return isinstance(function, (torch.nn.SiLU, SiLUActivation)) or function is torch.nn.functional.silu


def _interleaved_gate(act_fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    """The default gate on interleaved rows [g0, u0, g1, u1, ...]: act_fn(gate) * up."""
    def gate(gate_up: torch.Tensor) -> torch.Tensor:
        return act_fn(gate_up[..., 0::2]) * gate_up[..., 1::2]
    return gate


def _gpt_oss_unit(module: torch.nn.Module) -> Optional[GatedUnit]:
    """The GatedUnit of gpt-oss' own ``_apply_gate`` (clamped g * sigmoid(alpha g) * (u + 1) on
    alternating columns) when `module` runs exactly that function with finite settings, so that
    tutel fuses it; None for any other gate (a subclass overriding it included)."""
    try:
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
    except ImportError:  # a transformers without gpt-oss
        return None
    if getattr(type(module), "_apply_gate", None) is not GptOssExperts._apply_gate:
        return None
    alpha, limit = getattr(module, "alpha", None), getattr(module, "limit", None)
    finite = all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in (alpha, limit))
    if not finite or limit <= 0:
        return None
    return GatedUnit(float(alpha), 1.0, float(limit), interleaved=True)


def _gate_rule(module: torch.nn.Module, concatenated: bool, up_width: int, inner: int):
    """(gate, gate_fn) for a gated module: the class's own ``_apply_gate`` when it defines one
    (it knows its layout), else transformers' default rule on the declared layout."""
    if getattr(type(module), "_apply_gate", None) is not _default_apply_gate:
        return _gpt_oss_unit(module), _callable(module, "_apply_gate", "_apply_gate")
    if up_width != 2 * inner:
        raise UnsupportedExpertsLayout(
            module, "has_gate", f"the gate/up projection has {up_width} outputs, but the default gate needs twice "
                                f"the down projection's {inner} inputs")
    act_fn = _callable(module, "act_fn", "act_fn")
    if not concatenated:
        return None, _interleaved_gate(act_fn)
    if _is_silu(act_fn):
        return "swiglu", module._apply_gate
    return None, module._apply_gate


def read_layout(module: torch.nn.Module) -> ExpertsLayout:
    """The layout of a transformers experts module; raises UnsupportedExpertsLayout when the
    flags and the module's tensors do not describe experts tutel can run."""
    has_gate, has_bias, transposed, concatenated, post_norm, expert_parallel = (_flag(module, f) for f in FLAGS)
    up_name = "gate_up_proj" if has_gate else "up_proj"
    up_weight = _weight(module, up_name, "has_gate", 3)
    down_weight = _weight(module, "down_proj", "down_proj", 3)
    num_experts = getattr(module, "num_experts", None)
    if not isinstance(num_experts, int) or isinstance(num_experts, bool):
        raise UnsupportedExpertsLayout(module, "num_experts", f"must be an int, got {num_experts!r}")
    for name, tensor in ((up_name, up_weight), ("down_proj", down_weight)):
        if tensor.shape[0] != num_experts:
            raise UnsupportedExpertsLayout(
                module, "_is_expert_parallel" if expert_parallel else "num_experts",
                f"`{name}` holds {tensor.shape[0]} experts but num_experts is {num_experts}")
    # [E, out, in] (F.linear) or [E, in, out] (is_transposed); the tokens' width is checked per call
    up_out = up_weight.shape[2] if transposed else up_weight.shape[1]
    down_in, down_out = (down_weight.shape[1], down_weight.shape[2]) if transposed \
        else (down_weight.shape[2], down_weight.shape[1])
    up_bias = down_bias = None
    if has_bias:
        up_bias = _weight(module, up_name + "_bias", "has_bias", 2)
        down_bias = _weight(module, "down_proj_bias", "has_bias", 2)
        for name, bias, width in ((up_name + "_bias", up_bias, up_out), ("down_proj_bias", down_bias, down_out)):
            if tuple(bias.shape) != (num_experts, width):
                raise UnsupportedExpertsLayout(module, "has_bias", f"`{name}` must be [{num_experts}, {width}], got "
                                                                   f"{tuple(bias.shape)}")
    gate = gate_fn = activation = None
    if has_gate:
        gate, gate_fn = _gate_rule(module, concatenated, up_out, down_in)
    else:
        if up_out != down_in:
            raise UnsupportedExpertsLayout(module, "has_gate", f"without a gate `up_proj` must have the down "
                                                               f"projection's {down_in} outputs, got {up_out}")
        activation = _callable(module, "act_fn", "act_fn")
    post_fn = _callable(module, "post_expert_norm", "has_post_expert_norm") if post_norm else None
    return ExpertsLayout(up_weight, down_weight, up_bias, down_bias, transposed, gate, gate_fn, activation, post_fn,
                         num_experts, expert_parallel)
