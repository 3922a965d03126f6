"""transformers' FP8 experts (``FP8Experts``, transformers.integrations.finegrained_fp8) through
"tutel", on the CPU and CUDA.

transformers builds the experts of a fine-grained FP8 checkpoint (DeepSeek-V3's format:
float8_e4m3fn weights, one scale per 128 x 128 block) as ``FP8Experts`` and looks their forward up
in ``ALL_FP8_EXPERTS_FUNCTIONS``, a registry apart from ``ALL_EXPERTS_FUNCTIONS``;
``registration.register`` adds "tutel" there with ``tutel_fp8_experts_forward``.  It reads the
module once per state of the module (``module_experts.kept_reading``) into tutel.quant
``Fp8BlockWeights`` over the module's own tensors (views, no copies) and runs
``tutel.experts.quantized.run_quantized``: tutel's decode_quantized_experts operator at decoding
sizes (weight-only), its quantized_grouped_linear products over the rows grouped by expert
otherwise; float32 accumulation, the activations in the model's dtype between the products.

What is read, and from where:

* the gate form from the parameters present: ``gate_up_proj`` (E, 2I, H) [gate; up] rows, or
  ``up_proj`` (E, I, H) for experts without a gate (transformers 5.23-5.24 reset the ``has_gate``
  flag to True on such modules, so the flag is not read), with ``down_proj`` (E, H, I), each with
  its ``*_scale_inv``;
* the block from ``block_size`` (``weight_block_size`` where a module names it so; None: one
  scale per matrix).  A fused gate/up matrix whose intermediate size I is no multiple of the
  block's rows has two scale grids one after the other where its checkpoint quantized gate and up
  apart (DeepSeek-V3's separate ``gate_proj`` / ``up_proj``; transformers allocates at least two
  scale rows for it): 2 x ceil(I / b0) scale rows are read so, as gate and up stacks of their own;
  ceil(2I / b0) rows as one fused stack;
* the gate rule: transformers' own ``FP8Experts._apply_gate`` without softcap or clamp and with a
  SiLU ``act_fn`` runs as tutel's fused SwiGLU unit; any other gate is the module's
  ``_apply_gate``, called as it is; experts without a gate take ``act_fn``;
* the activations from ``activation_scheme``: "dynamic" runs W8A8 as transformers' kernels do
  (each product's input quantized per token and per block of columns, scale amax / 448);
  "static" (calibrated activation scales) raises NotImplementedError naming it.
  ``enable(model, fp8_activations=...)`` overrides the scheme per module ("weight_only": the
  activations unquantized; "dynamic").

The experts run on the CPU and on CUDA, where nothing is read back to the host (W8A8's activations
are quantized inside the products' kernels, or by elementwise PyTorch operators on the device where
the block's width is neither a multiple of 16 nor the whole row).  Tokens on another device than the
module's tensors raise ValueError, float64 tokens on CUDA TypeError (their path runs on the CPU).
Inference only: a call that autograd would record raises NotImplementedError saying what to do.
"""
import math
import weakref
from typing import Callable, NamedTuple, Optional, Tuple

import torch
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily

from ...experts.quantized import run_quantized
from ...ops.backend import fake_mode_active
from ...ops.gated_units import SWIGLU, GatedUnit
from ...ops.quantized_experts import ACTIVATIONS, DYNAMIC, check_quantized_experts, require_device
from ...paths import QuantizedExperts
from ...quant import Fp8BlockWeights
from .forward import experts_forward
from .layout import FLAGS, UnsupportedExpertsLayout, _callable, _flag, is_silu
from .module_experts import kept_reading, seen_by_key

# The instance attribute enable(model, fp8_activations=...) sets: overrides activation_scheme.
FP8_ACTIVATIONS = "tutel_fp8_activations"

# What a reading depends on besides the tensors: kept only where each is on the instance.
_SCALARS_AND_FUNCTIONS = ("num_experts", "act_fn", "activation_scheme", "block_size", "weight_block_size",
                          "gate_softcap", "up_softcap", "swiglu_alpha", "limit", FP8_ACTIVATIONS) + FLAGS

_ENTRY = "_tutel_fp8_experts"


def fp8_experts_class() -> Optional[type]:
    """transformers' ``FP8Experts`` class, or None where the installed release has none."""
    try:
        from transformers.integrations.finegrained_fp8 import FP8Experts
    except ImportError:
        return None
    return FP8Experts


def is_fp8_experts(module: torch.nn.Module) -> bool:
    """Whether `module` is one of transformers' FP8 experts (an instance of ``FP8Experts``)."""
    cls = fp8_experts_class()
    return cls is not None and isinstance(module, cls)


class Fp8ExpertsLayout(NamedTuple):
    """An FP8 experts module read as tutel.quant stacks over its own tensors, and its rules."""
    up: Fp8BlockWeights                  # [gate; up] rows, the ups alone (with gate_weight), or up_proj
    gate_weight: Optional[Fp8BlockWeights]  # the gates' rows where gate and up are scaled apart
    down: Fp8BlockWeights
    unit: Optional[GatedUnit]
    gate_fn: Optional[Callable[[torch.Tensor], torch.Tensor]]
    activation: Optional[Callable[[torch.Tensor], torch.Tensor]]
    activations: str                     # "weight_only" or "dynamic"
    num_experts: int
    expert_parallel: bool
    tensors: Tuple[torch.Tensor, ...]    # the module's up weight and scales, down weight and scales
    split: Optional[Tuple[int, int]]     # (gate rows, gate scale rows) where gate and up are scaled apart

    @property
    def model_dim(self) -> int:
        """The width of the tokens the experts take (and give back)."""
        return self.up.in_features


def _tensor(module: torch.nn.Module, name: str) -> torch.Tensor:
    tensor = getattr(module, name, None)
    if not isinstance(tensor, torch.Tensor):
        raise UnsupportedExpertsLayout(module, name, f"expects a tensor `{name}`, the module has "
                                                     f"{type(tensor).__name__}")
    return tensor


def _fp8_weight(module: torch.nn.Module, name: str) -> torch.Tensor:
    tensor = _tensor(module, name)
    if tensor.dtype != torch.float8_e4m3fn:
        hint = " (FP4-packed experts, expert_dtype='fp4', are not supported yet)" if tensor.dtype == torch.int8 \
            else ""
        raise UnsupportedExpertsLayout(module, name, f"`{name}` must be float8_e4m3fn FP8 codes, got {tensor.dtype}"
                                                     f"{hint}")
    if tensor.dim() != 3:
        raise UnsupportedExpertsLayout(module, name, f"`{name}` must be (experts, out, in), got shape "
                                                     f"{tuple(tensor.shape)}")
    return tensor


def _block(module: torch.nn.Module) -> Optional[Tuple[int, int]]:
    """The module's (rows, columns) scale block, or None for one scale per matrix."""
    name = "block_size" if hasattr(module, "block_size") or not hasattr(module, "weight_block_size") \
        else "weight_block_size"
    block = getattr(module, name, None)
    if block is None:
        return None
    if isinstance(block, torch.Tensor) or not hasattr(block, "__len__") or len(block) != 2 or \
            not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block):
        raise UnsupportedExpertsLayout(module, name, f"must be two integers > 0 (rows, columns) or None, "
                                                     f"got {block!r}")
    return int(block[0]), int(block[1])


def _values_unreadable(*tensors: torch.Tensor) -> bool:
    """Whether the tensors' values cannot be read: fake tensors (a trace on fake CUDA tensors, as
    tests/python/launch_count.py makes) or tensors on the meta device."""
    return fake_mode_active() or any(isinstance(t, FakeTensor) or t.device.type == "meta" for t in tensors)


def _stack(module: torch.nn.Module, name: str, weight: torch.Tensor, scale: torch.Tensor,
           block: Tuple[int, int], gate_up_rows: Optional[str] = None) -> Fp8BlockWeights:
    try:
        if _values_unreadable(weight, scale):
            # Shapes, dtypes and block checked on a stand-in of one zero element per tensor (expanded
            # to their shapes, on the CPU), then its format put over the tensors: their values (the
            # scales' finiteness) cannot be read, and a read would be a host synchronisation.
            def stand_in(tensor):
                return torch.zeros((1,) * tensor.dim(), dtype=tensor.dtype, device="cpu").expand(tensor.shape)
            with unset_fake_temporarily():
                template = Fp8BlockWeights(stand_in(weight), stand_in(scale), block=block, gate_up_rows=gate_up_rows)
            if weight.device != scale.device:
                raise ValueError(f"scale_inv: on {scale.device} but weight on {weight.device}; expected all tensors "
                                 f"of one expert stack on one device")
            return template.with_tensors({"weight": weight, "scale_inv": scale})
        return Fp8BlockWeights(weight, scale, block=block, gate_up_rows=gate_up_rows)
    except (TypeError, ValueError) as error:
        raise UnsupportedExpertsLayout(module, name, f"`{name}` and `{name}_scale_inv` are no block-FP8 stack: "
                                                     f"{error}") from None


def _gate_up_stacks(module: torch.nn.Module, weight: torch.Tensor, scale: torch.Tensor,
                    block: Optional[Tuple[int, int]], concatenated: bool):
    """(up, gate_weight, split) of a fused [gate; up] matrix (see the module docstring)."""
    rows, columns = weight.shape[1], weight.shape[2]
    if rows % 2:
        raise UnsupportedExpertsLayout(module, "gate_up_proj", f"`gate_up_proj` needs 2 x intermediate rows, got "
                                                               f"shape {tuple(weight.shape)}")
    inner = rows // 2
    fused_block = block or (rows, columns)
    apart_block = block or (inner, columns)
    fused_rows = math.ceil(rows / fused_block[0])
    apart_rows = 2 * math.ceil(inner / apart_block[0])
    scale_rows = scale.shape[1] if scale.dim() == 3 else None
    # Scaled apart when the grid has the two halves' rows and they cannot be the fused grid's
    # (equal counts with I a multiple of the block's rows are one and the same grid).
    if scale_rows == apart_rows and (apart_rows != fused_rows or inner % apart_block[0]):
        if not concatenated:
            raise UnsupportedExpertsLayout(module, "is_concatenated", "gate and up rows scaled apart need "
                                                                      "is_concatenated=True ([gate; up] rows)")
        half = apart_rows // 2
        gate = _stack(module, "gate_up_proj", weight[:, :inner], scale[:, :half], apart_block)
        up = _stack(module, "gate_up_proj", weight[:, inner:], scale[:, half:], apart_block)
        return up, gate, (inner, half)
    rows_order = "concatenated" if concatenated else "interleaved"
    return _stack(module, "gate_up_proj", weight, scale, fused_block, rows_order), None, None


def _activations(module: torch.nn.Module) -> str:
    """The activations mode, "weight_only" or "dynamic": enable's override, else the module's
    activation_scheme."""
    chosen = getattr(module, FP8_ACTIVATIONS, None)
    if chosen is not None:
        if chosen not in ACTIVATIONS:
            raise UnsupportedExpertsLayout(module, FP8_ACTIVATIONS, f"must be one of {ACTIVATIONS} or None, got "
                                                                    f"{chosen!r}")
        return chosen
    scheme = getattr(module, "activation_scheme", DYNAMIC)
    if scheme == DYNAMIC:
        return DYNAMIC
    if scheme == "static":
        raise NotImplementedError(
            f'experts_implementation="tutel": {type(module).__name__} (activation_scheme): activation_scheme="static" '
            f"(calibrated activation scales) is not implemented for FP8 experts; tutel runs "
            f'activation_scheme="dynamic", or the activations unquantized with '
            f'tutel.integrations.transformers.enable(model, fp8_activations="weight_only")')
    raise UnsupportedExpertsLayout(module, "activation_scheme", f'must be "dynamic" or "static", got {scheme!r}')


def _gate_rule(module: torch.nn.Module, concatenated: bool):
    """(unit, gate_fn): the fused SwiGLU for transformers' own plain gate with a SiLU, else the
    module's ``_apply_gate``."""
    gate_fn = _callable(module, "_apply_gate", "_apply_gate")
    own = getattr(fp8_experts_class(), "_apply_gate", None)
    plain = own is not None and getattr(type(module), "_apply_gate", None) is own and \
        all(getattr(module, name, None) is None for name in ("gate_softcap", "swiglu_alpha", "limit"))
    if plain and concatenated and is_silu(_callable(module, "act_fn", "act_fn")):
        return SWIGLU, None
    return None, gate_fn


def read_fp8_layout(module: torch.nn.Module) -> Fp8ExpertsLayout:
    """The layout of one of transformers' FP8 experts modules (see the module docstring).

    Raises:
        UnsupportedExpertsLayout: flags, tensors or settings tutel cannot run, naming the module
            class and the flag or tensor.
        NotImplementedError: activation_scheme="static", or the module's tensors on another device
            than the CPU or a CUDA device.
    """
    _, has_bias, transposed, concatenated, post_norm, expert_parallel = (
        None if flag == "has_gate" else _flag(module, flag) for flag in FLAGS)
    for flag, value, problem in (("has_bias", has_bias, "FP8 experts with biases are not supported"),
                                 ("is_transposed", transposed, "FP8 experts are stored [E, out, in]"),
                                 ("has_post_expert_norm", post_norm, "transformers' FP8 experts apply no norm "
                                                                     "after each expert")):
        if value:
            raise UnsupportedExpertsLayout(module, flag, problem)
    present = [name for name in ("gate_up_proj", "up_proj") if isinstance(getattr(module, name, None), torch.Tensor)]
    if len(present) != 1:
        raise UnsupportedExpertsLayout(module, "has_gate", f"expects one tensor of `gate_up_proj` (gated) and "
                                                           f"`up_proj` (no gate), the module has {present or 'none'}")
    up_name = present[0]
    tensors = (_fp8_weight(module, up_name), _tensor(module, up_name + "_scale_inv"),
               _fp8_weight(module, "down_proj"), _tensor(module, "down_proj_scale_inv"))
    activations = _activations(module)
    where = f'experts_implementation="tutel": {type(module).__name__}'
    for name, tensor in zip((up_name, up_name + "_scale_inv", "down_proj", "down_proj_scale_inv"), tensors):
        require_device(tensor.device, f"{where}: `{name}`")
    num_experts = getattr(module, "num_experts", None)
    if not isinstance(num_experts, int) or isinstance(num_experts, bool):
        raise UnsupportedExpertsLayout(module, "num_experts", f"must be an int, got {num_experts!r}")
    block = _block(module)
    up_weight, up_scale, down_weight, down_scale = tensors
    gate_weight = split = unit = gate_fn = activation = None
    if up_name == "gate_up_proj":
        up, gate_weight, split = _gate_up_stacks(module, up_weight, up_scale, block, concatenated)
        unit, gate_fn = _gate_rule(module, concatenated)
    else:
        up = _stack(module, "up_proj", up_weight, up_scale, block or tuple(up_weight.shape[1:]))
        activation = _callable(module, "act_fn", "act_fn")
    down = _stack(module, "down_proj", down_weight, down_scale, block or tuple(down_weight.shape[1:]))
    for name, stack in ((up_name, up), ("down_proj", down)):
        if stack.experts != num_experts:
            raise UnsupportedExpertsLayout(
                module, "_is_expert_parallel" if expert_parallel else "num_experts",
                f"`{name}` holds {stack.experts} experts but num_experts is {num_experts}")
    try:
        width = check_quantized_experts(up, down, gate_weight, up_name == "gate_up_proj", activations, where)
    except ValueError as error:
        raise UnsupportedExpertsLayout(module, "down_proj", str(error)) from None
    if down.out_features != width:
        raise UnsupportedExpertsLayout(module, "down_proj", f"`down_proj` gives {down.out_features} outputs, but the "
                                                            f"experts take tokens of {width} features")
    return Fp8ExpertsLayout(up, gate_weight, down, unit, gate_fn, activation, activations, num_experts,
                            expert_parallel, tensors, split)


class KeptFp8Layout:
    """What an FP8 experts module's layout gives a call: its tensors by weak reference where the
    layout is kept (a kept layout must not keep replaced weights alive), the checked stacks as
    templates on the meta device, which each call puts over the tensors as they are then
    (``Fp8BlockWeights.with_tensors``: no values read again), and the rules."""
    __slots__ = ("tensors", "weak", "templates", "split", "unit", "gate_fn", "activation", "activations",
                 "num_experts", "expert_parallel", "model_dim")

    def __init__(self, layout: Fp8ExpertsLayout, on_death: Optional[Callable] = None):
        self.weak = on_death is not None
        stacks = (layout.up, layout.gate_weight, layout.down)
        if self.weak:
            self.tensors = tuple(weakref.ref(t, on_death) for t in layout.tensors)
            self.templates = tuple(None if s is None else s.to("meta") for s in stacks)
        else:  # (torch.compile: read in the trace, nothing kept)
            self.tensors, self.templates = layout.tensors, stacks
        self.split, self.unit, self.gate_fn, self.activation, self.activations = \
            layout.split, layout.unit, layout.gate_fn, layout.activation, layout.activations
        self.num_experts, self.expert_parallel, self.model_dim = \
            layout.num_experts, layout.expert_parallel, layout.model_dim

    def experts(self) -> QuantizedExperts:
        """The experts over the module's tensors as they are now."""
        up, gate, down = self.templates
        if self.weak:
            up_weight, up_scale, down_weight, down_scale = (reference() for reference in self.tensors)
            if self.split is None:
                up = up.with_tensors({"weight": up_weight, "scale_inv": up_scale})
            else:
                rows, scale_rows = self.split
                gate = gate.with_tensors({"weight": up_weight[:, :rows], "scale_inv": up_scale[:, :scale_rows]})
                up = up.with_tensors({"weight": up_weight[:, rows:], "scale_inv": up_scale[:, scale_rows:]})
            down = down.with_tensors({"weight": down_weight, "scale_inv": down_scale})
        return QuantizedExperts(up, down, gate, self.unit, self.gate_fn, self.activation, self.activations)


def _read_kept(module: torch.nn.Module, on_death: Optional[Callable]) -> Tuple[KeptFp8Layout, bool]:
    layout = read_fp8_layout(module)
    return KeptFp8Layout(layout, on_death), seen_by_key(module, layout.tensors, _SCALARS_AND_FUNCTIONS)


def kept_fp8_layout(module: torch.nn.Module) -> KeptFp8Layout:
    """The layout of FP8 experts `module`, kept while the module holds the objects it was read from."""
    return kept_reading(module, _ENTRY, _read_kept)


tutel_fp8_experts_forward = experts_forward(kept_fp8_layout, run_quantized, "tutel_fp8_experts_forward", """\
Runs one of transformers' FP8 experts modules (``self``) through tutel on the CPU or CUDA.

Args:
    self: an ``FP8Experts`` module (declared with ``@use_experts_implementation``).
    hidden_states: [T, H] tokens on the module's device (bfloat16, float16, float32; float64 on
        the CPU).
    top_k_index: [T, k] chosen experts; ids outside [0, num_experts) contribute nothing.
    top_k_weights: [T, k] routing weights.

Returns:
    [T, H] in ``hidden_states``' dtype.

Raises:
    UnsupportedExpertsLayout: the module's flags or tensors describe experts tutel cannot run.
    NotImplementedError: activation_scheme="static", or a call autograd would record.
    ValueError: tokens or expert ids on another device than the module's tensors.
    TypeError: float64 tokens on CUDA.
""")
