"""How the tensors of a transformers experts module are laid out: the one reader of them, used by
the "tutel" experts implementation (``forward``, ``module_experts``, ``registration``) and by
``replace_moe_blocks`` (``block_layouts``).

transformers' ``@use_experts_implementation(...)`` decorator stores the layout of an experts
module on each instance: ``has_gate``, ``has_bias``, ``is_transposed``, ``is_concatenated``,
``has_post_expert_norm`` and the expert-parallel marker ``_is_expert_parallel``; a class may
also replace the gate rule by defining ``_apply_gate``.  A flag that the installed release does
not set yet takes the value that release's code implies (``versions.implied_flags``).  A few experts
classes transformers ships without the decorator have the layout their code fixes
(``UNDECORATED_LAYOUTS``); ``replace_moe_blocks`` reads them, the experts implementation never
runs them (transformers does not dispatch them, ``is_dispatched``).

``read_layout`` checks a module against its flags (the flag, the tensors it implies and their
shapes) and raises ``UnsupportedExpertsLayout``, naming the module class and the flag, for
anything the tutel experts cannot run exactly.  Only shapes and Python attributes are read, so
under ``torch.compile`` the checks are settled at trace time and cost nothing afterwards.
"""
import math
from typing import Callable, Dict, NamedTuple, Optional, Union

import torch
from transformers.activations import SiLUActivation
from transformers.integrations.moe import _default_apply_gate, use_experts_implementation

from ...ops.gated_units import GatedUnit, split_gate_up
from .versions import implied_flags, installed_version

# The flags the decorator sets, in the order they are checked.
FLAGS = ("has_gate", "has_bias", "is_transposed", "is_concatenated", "has_post_expert_norm", "_is_expert_parallel")

# The flags the installed release does not set, with the values its code implies.
_IMPLIED_FLAGS = implied_flags(installed_version())

# Experts classes without the decorator whose forward fixes their layout (class name -> flags).
UNDECORATED_LAYOUTS: Dict[str, Dict[str, bool]] = {
    # Llama 4: concatenated SwiGLU halves, weights [E, H, 2I] and [E, I, H] used as bmm operands
    "Llama4TextExperts": dict(has_gate=True, has_bias=False, is_transposed=True, is_concatenated=True,
                              has_post_expert_norm=False, _is_expert_parallel=False),
}


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

    @property
    def model_dim(self) -> int:
        """The width of the tokens the experts take (and give back)."""
        return self.up_weight.shape[1] if self.transposed else self.up_weight.shape[2]

    @property
    def inner_dim(self) -> int:
        """The width of each expert's hidden values (the down projection's inputs)."""
        return self.down_weight.shape[1] if self.transposed else self.down_weight.shape[2]


def is_dispatched(module: torch.nn.Module) -> bool:
    """Whether transformers runs `module` through ``ExpertsInterface``: its class's forward is the
    one ``@use_experts_implementation`` installs (which looks the experts implementation up by name)."""
    forward = getattr(type(module), "forward", None)
    code = getattr(forward, "__code__", None)
    return hasattr(forward, "__wrapped__") and code is not None and \
        code.co_filename == use_experts_implementation.__code__.co_filename


def is_silu(function: Callable) -> bool:
    """Whether `function` is known to compute x * sigmoid(x) exactly as F.silu does."""
    return isinstance(function, (torch.nn.SiLU, SiLUActivation)) or function is torch.nn.functional.silu


def _flag(module: torch.nn.Module, name: str) -> bool:
    fixed = UNDECORATED_LAYOUTS.get(type(module).__name__)
    if fixed is not None and not is_dispatched(module):
        return fixed[name]
    if not hasattr(module, name):
        if name in _IMPLIED_FLAGS:
            return _IMPLIED_FLAGS[name]
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


def _default_gate(act_fn: Callable[[torch.Tensor], torch.Tensor],
                  interleaved: bool) -> Callable[[torch.Tensor], torch.Tensor]:
    """transformers' default gate rule, act_fn(gate) * up, on concatenated halves [g | u] or on
    interleaved rows [g0, u0, g1, u1, ...]."""
    def gate(gate_up: torch.Tensor) -> torch.Tensor:
        gate_values, up = split_gate_up(gate_up, interleaved)
        return act_fn(gate_values) * up
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


def has_default_gate(module: torch.nn.Module) -> bool:
    """Whether a gated experts module runs transformers' default gate rule, act_fn(gate) * up
    (its class defines no ``_apply_gate`` of its own)."""
    return getattr(type(module), "_apply_gate", _default_apply_gate) is _default_apply_gate


def _gate_rule(module: torch.nn.Module, concatenated: bool, up_width: int, inner: int):
    """(gate, gate_fn) for a gated module: the class's own ``_apply_gate`` when it defines one
    (it knows its layout), else transformers' default rule on the declared layout."""
    if not has_default_gate(module):
        return _gpt_oss_unit(module), _callable(module, "_apply_gate", "_apply_gate")
    if up_width != 2 * inner:
        raise UnsupportedExpertsLayout(
            module, "has_gate", f"the gate/up projection has {up_width} outputs, but the default gate needs twice "
                                f"the down projection's {inner} inputs")
    act_fn = _callable(module, "act_fn", "act_fn")
    gate_fn = _default_gate(act_fn, interleaved=not concatenated)
    return ("swiglu" if concatenated and is_silu(act_fn) else None), gate_fn


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
    up_in, up_out = (up_weight.shape[1], up_weight.shape[2]) if transposed else (up_weight.shape[2], up_weight.shape[1])
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
    if down_out != up_in:
        raise UnsupportedExpertsLayout(module, "down_proj", f"`down_proj` gives {down_out} outputs, but the experts "
                                                            f"take tokens of {up_in} features")
    post_fn = _callable(module, "post_expert_norm", "has_post_expert_norm") if post_norm else None
    return ExpertsLayout(up_weight, down_weight, up_bias, down_bias, transposed, gate, gate_fn, activation, post_fn,
                         num_experts, expert_parallel)
