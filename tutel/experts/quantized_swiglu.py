"""SwiGLU experts whose matrices are quantized stacks (tutel.quant), for moe_layer's inference on the
CPU and CUDA (``{'type': 'quantized_swiglu', ...}``, or ``layer.quantize_experts(format)`` on a layer of
``llama_ffn`` or ``clamped_swiglu`` experts).

For each expert e, on tokens x [n, H]:

    [g, u] = x Wup[e]^T (+ up_bias[e])        (Wup: E x 2I x H, or the gates' Wgate: E x I x H apart)
    h      = unit(g, u)                       (silu(g) * u; gpt-oss: (u' + 1) * g' * sigmoid(alpha g'))
    y      = h Wdown[e]^T (+ down_bias[e])    (Wdown: E x H x I)

with each matrix dequantized one expert at a time as its format defines it
(tutel.ops.quantized_experts: float32 accumulation, float64 for float64 tokens, the activations in
the tokens' dtype between the products).  The stacks' codes and scales are the module's buffers,
named ``<role>_<tensor>`` (``up_weight`` / ``up_scale_inv`` for block FP8, ``up_packed`` /
``up_scales`` for MXFP4, ``up_packed`` / ``up_block_scales`` / ``up_global_scales`` for NVFP4;
roles ``gate``, ``up``, ``down``), with the biases ``up_bias`` [E, 2I] and ``down_bias`` [E, H]: so
``state_dict`` / ``load_state_dict`` carry the packed tensors as they are, ``.to(device)`` moves
them, and a dtype conversion (``.to(torch.bfloat16)``, ``.half()``) converts the biases only, never
the codes or scales.  Nothing else is resident: the module's bytes are the stacks' packed bytes plus
the biases.

On CUDA (``layer.cuda()`` moves the buffers) the layer's static grouped path groups the rows on
the device and the experts run tutel's quantized_grouped_linear for both products with the group
ends as a device tensor: no host synchronisation.  16-bit biases are kept converted to float32 (what
the operators add) beside the buffers, not in the state_dict.  float64 tokens run on the CPU only
(TypeError on CUDA); tokens on another device than the buffers raise ValueError.  Inference only: a
call in which autograd would record through the experts (grad mode on and their input requiring a
gradient) raises NotImplementedError saying what to do.  Each process holds whole experts
(``sharded_count`` 1), and adaptive_r = 0 over several processes (every expert on every process) is
not offered.
"""
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ..ops.gated_units import SWIGLU, GatedUnit, check_unit, split_gate_up
from ..ops.quantized_experts import (WEIGHT_ONLY, Float32Copies, check_activations, projection_row_bytes,
                                     quantized_expert_products, require_device, require_rows_dtype,
                                     require_same_device)
from ..quant import GateUpRows, QuantizedWeights
from ._grouped import flatten_features, run_padded

WHERE = "tutel.experts.quantized_swiglu"
ROLES = ("gate", "up", "down")
_BIAS_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


class ActivatedGate:
    """act(gate) * up on [n, 2I] gate and up values (a gate rule of another activation than SiLU)."""

    def __init__(self, activation: Callable[[torch.Tensor], torch.Tensor], interleaved: bool):
        self.activation, self.interleaved = activation, interleaved

    def __call__(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = split_gate_up(gate_up, self.interleaved)
        return self.activation(gate) * up


def _require_stack(name: str, stack: object) -> QuantizedWeights:
    if not isinstance(stack, QuantizedWeights):
        raise TypeError(f"{WHERE}: `{name}` must be a tutel.quant stack (Fp8BlockWeights, Mxfp4Weights, "
                        f"Nvfp4Weights), got {type(stack).__name__}")
    return stack


def _require_bias(name: str, bias: Optional[torch.Tensor], shape: Tuple[int, int],
                  device: torch.device) -> Optional[torch.Tensor]:
    if bias is None:
        return None
    if not isinstance(bias, torch.Tensor) or bias.dtype not in _BIAS_DTYPES:
        what = f"dtype {bias.dtype}" if isinstance(bias, torch.Tensor) else type(bias).__name__
        raise ValueError(f"{WHERE}: `{name}` ({what}) must be a float32 / float64 / bfloat16 / float16 tensor")
    if tuple(bias.shape) != shape:
        raise ValueError(f"{WHERE}: `{name}` has shape {tuple(bias.shape)}; expected {shape} (experts, outputs)")
    if bias.device != device:
        raise ValueError(f"{WHERE}: `{name}` is on {bias.device}, the stacks on {device}")
    return bias.detach()


def _check_stacks(model_dim: int, experts: int, up: QuantizedWeights, down: QuantizedWeights,
                  gate_weight: Optional[QuantizedWeights], unit: GatedUnit, activations: str) -> int:
    """Checks the stacks against each other and the layer; returns the hidden size I."""
    stacks = [("up", up), ("down", down)] + ([("gate_weight", gate_weight)] if gate_weight is not None else [])
    for name, stack in stacks:
        if stack.experts != experts:
            raise ValueError(f"{WHERE}: `{name}` {stack.shape} holds {stack.experts} experts; the layer holds "
                             f"num_experts_per_device={experts} on each process")
        if stack.device != up.device:
            raise ValueError(f"{WHERE}: `{name}` is on {stack.device} but `up` on {up.device}")
    if up.in_features != model_dim:
        raise ValueError(f"{WHERE}: `up` {up.shape} takes {up.in_features} features; the layer's model_dim is "
                         f"{model_dim}")
    if gate_weight is not None:
        if gate_weight.shape != up.shape:
            raise ValueError(f"{WHERE}: `gate_weight` {gate_weight.shape} must have the shape of `up` {up.shape}")
        if unit.interleaved:
            raise ValueError(f"{WHERE}: with `gate_weight` the gate rule sees [gate | up] concatenated; "
                             f"`unit` {unit} must not be interleaved")
        hidden = up.out_features
    else:
        if up.out_features % 2:
            raise ValueError(f"{WHERE}: `up` {up.shape} must hold 2 x hidden rows (gate and up), or pass the "
                             f"gates apart as `gate_weight`")
        rows = up.gate_up_rows
        if rows is not None and (rows is GateUpRows.INTERLEAVED) != bool(unit.interleaved):
            raise ValueError(f"{WHERE}: `up` orders its rows {rows.value!r} but `unit` has "
                             f"interleaved={unit.interleaved}")
        hidden = up.out_features // 2
    if down.shape[1:] != (model_dim, hidden):
        raise ValueError(f"{WHERE}: `down` {down.shape} must be (experts, {model_dim}, {hidden}): model_dim "
                         f"outputs of the {hidden} hidden values")
    check_activations(activations, stacks, WHERE)
    return hidden


class QuantizedSwiGLUExperts(torch.nn.Module):
    """``num_experts_per_device`` SwiGLU experts over quantized stacks (see the module docstring).

    Args:
        model_dim: H, the tokens' features (the experts give back H as well).
        num_experts_per_device: E, the experts this process holds: each stack's first dimension.
        sharded_count: processes sharing one expert; only 1 (whole experts) is offered.
        up: (E, 2I, H) gate and up rows (``unit.interleaved``: alternating, as gpt-oss; else the
            gates first, as transformers' ``gate_up_proj``), or the ups alone (E, I, H) with
            `gate_weight`.
        down: (E, H, I) down projections.
        gate_weight: the gates' own (E, I, H) stack (llama_ffn's W1, quantized apart), or None.
        up_bias: [E, 2I] bias of the up projection, in `up`'s row order (gpt-oss), [gate | up] with
            `gate_weight`; or None.
        down_bias: [E, H] bias of the down projection, or None.
        unit: the gated unit (tutel.ops.gated_units.GatedUnit): SWIGLU is silu(g) * u, gpt-oss'
            ``GatedUnit(1.702, 1.0, 7.0, interleaved=True)``.
        activation_fn: another activation than SiLU: h = activation_fn(g) * u (`unit` unused).
        activations: "weight_only", or "dynamic" (W8A8 as DeepSeek-V3 prescribes, block FP8 only).

    From packed tensors: ``moe_layer(gate_type, model_dim=H, experts={'type': 'quantized_swiglu',
    'num_experts_per_device': E, 'up': Mxfp4Weights(packed, scales, gate_up_rows='interleaved'),
    'down': Mxfp4Weights(...), 'up_bias': b_up, 'down_bias': b_down, 'unit': GatedUnit(1.702, 1.0,
    7.0, True)})`` (any tutel.quant stacks: ``Fp8BlockWeights(weight, scale_inv, block=...)``,
    ``Nvfp4Weights.from_modelopt(...)``); the stacks' tensors are held as they are, not copied.
    From a float layer: ``layer.quantize_experts(format)``.

    A stack's metadata (format, block, row order) is fixed by the constructor: a state_dict loads
    into a module built with the same stacks' formats and shapes (``layer.quantize_experts`` with
    the same arguments on a layer of the same configuration builds one).
    """

    def __init__(self, model_dim: int, num_experts_per_device: int, sharded_count: int = 1, *,
                 up: QuantizedWeights, down: QuantizedWeights, gate_weight: Optional[QuantizedWeights] = None,
                 up_bias: Optional[torch.Tensor] = None, down_bias: Optional[torch.Tensor] = None,
                 unit: GatedUnit = SWIGLU, activation_fn: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
                 activations: str = WEIGHT_ONLY):
        super().__init__()
        if sharded_count != 1:
            raise ValueError(f"{WHERE}: quantized experts keep whole experts on each process; "
                             f"num_experts_per_device asks {sharded_count} processes to share one (use >= 1)")
        up, down = _require_stack("up", up), _require_stack("down", down)
        if gate_weight is not None:
            _require_stack("gate_weight", gate_weight)
        if not isinstance(unit, GatedUnit):
            raise TypeError(f"{WHERE}: `unit` must be a tutel.ops.gated_units.GatedUnit, got {type(unit).__name__}")
        check_unit(unit, WHERE)
        if activation_fn is not None and not callable(activation_fn):
            raise TypeError(f"{WHERE}: `activation_fn` must be callable, got {type(activation_fn).__name__}")
        hidden = _check_stacks(model_dim, num_experts_per_device, up, down, gate_weight, unit, activations)
        self.model_dim, self.output_dim = model_dim, model_dim
        self.hidden_size_per_expert = hidden
        self.local_experts = num_experts_per_device
        self.sharded_count = 1
        self.unit, self.activation_fn, self.activations = unit, activation_fn, activations
        self._float32 = Float32Copies()  # the biases as the operators add them (not in the state_dict)
        self._gate_fn = None if activation_fn is None else ActivatedGate(activation_fn, unit.interleaved)
        stacks = {"gate": gate_weight, "up": up, "down": down}
        # The stacks' format and metadata on the meta device: each call puts them over the buffers
        # as they are then (moved or loaded), without reading their values again.
        self._templates: Dict[str, QuantizedWeights] = {}
        for role, stack in stacks.items():
            if stack is None:
                continue
            tensors = {name: tensor.detach() for name, tensor in stack.tensors().items()}  # (a checkpoint's
            # float8 tensors may be Parameters requiring grad)
            self._templates[role] = stack.with_tensors(tensors).to("meta")
            for name, tensor in tensors.items():
                self.register_buffer(f"{role}_{name}", tensor)
        self.register_buffer("up_bias", _require_bias("up_bias", up_bias, (num_experts_per_device, 2 * hidden),
                                                      up.device))
        self.register_buffer("down_bias", _require_bias("down_bias", down_bias, (num_experts_per_device, model_dim),
                                                        up.device))

    # -- the stacks ---------------------------------------------------------------------------

    @property
    def format(self) -> str:
        """The stacks' format name (tutel.quant.FORMATS)."""
        return self._templates["up"].format

    def packed_names(self) -> List[str]:
        """The buffers holding the stacks' codes and scales (the biases excluded)."""
        return [f"{role}_{name}" for role, template in self._templates.items() for name in template.tensors()]

    def stack(self, role: str) -> Optional[QuantizedWeights]:
        """The stack of `role` ("gate", "up" or "down") over the module's buffers as they are now."""
        if role not in ROLES:
            raise ValueError(f"{WHERE}: role={role!r} is not allowed; expected one of {ROLES}")
        template = self._templates.get(role)
        if template is None:
            return None
        return template.with_tensors({name: getattr(self, f"{role}_{name}") for name in template.tensors()})

    def stacks(self) -> Dict[str, QuantizedWeights]:
        """Every stack the module holds by role ("gate" only where the gates are apart)."""
        return {role: self.stack(role) for role in self._templates}

    def packed_bytes(self) -> int:
        """Bytes of the stacks' codes and scales (tutel.quant's packed_bytes, summed)."""
        return sum(stack.packed_bytes() for stack in self.stacks().values())

    def extra_repr(self) -> str:
        return (f"format={self.format!r}, model_dim={self.model_dim}, hidden_size_per_expert="
                f"{self.hidden_size_per_expert}, num_experts_per_device={self.local_experts}, unit={self.unit}, "
                f"gate_apart={'gate' in self._templates}, has_bias={self.up_bias is not None}, "
                f"activations={self.activations!r}")

    # -- devices, dtypes and checkpoints ---------------------------------------------------------

    def _apply(self, fn, recurse: bool = True):
        """Moves keep the codes' and scales' dtypes: a dtype conversion of the module converts the
        biases only (float8 codes and E8M0 scales are floating dtypes PyTorch would convert)."""
        packed = {id(self._buffers[name]) for name in self.packed_names()}

        def keeping_packed_dtypes(tensor: torch.Tensor) -> torch.Tensor:
            out = fn(tensor)
            if id(tensor) in packed and isinstance(out, torch.Tensor) and out.dtype != tensor.dtype:
                return tensor.to(device=out.device)
            return out
        return super()._apply(keeping_packed_dtypes, recurse)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        # Codes and scales load bit for bit: a tensor of another dtype would be converted silently.
        for name in self.packed_names():
            value = state_dict.get(prefix + name)
            own = self._buffers[name]
            if isinstance(value, torch.Tensor) and value.dtype != own.dtype:
                error_msgs.append(f"{WHERE}: `{prefix + name}` holds {value.dtype}; this {self.format} stack "
                                  f"holds {own.dtype} (load a checkpoint of the same format and options)")
                return
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        for role, template in self._templates.items():
            try:  # the format's own checks of the loaded values (E8M0 NaN bytes, non-finite scales)
                type(template)(**self.stack(role).tensors(), **template.metadata())
            except (TypeError, ValueError) as error:
                error_msgs.append(f"{WHERE}: the loaded `{prefix}{role}_*` tensors are no valid {self.format} "
                                  f"stack: {error}")

    # -- the computation ----------------------------------------------------------------------

    def _check_call(self, x: torch.Tensor, ctx) -> None:
        device = self._buffers["down_" + next(iter(self._templates["down"].tensors()))].device
        if x.device != device or device.type != "cpu":
            require_device(device, f"{WHERE}: the stacks")
            require_same_device(x.device, device, f"{WHERE}: the tokens")
            require_rows_dtype(x.dtype, device, f"{WHERE}: the tokens")
        if torch.is_grad_enabled() and (x.requires_grad or any(
                b is not None and b.requires_grad for b in (self.up_bias, self.down_bias))):
            raise NotImplementedError(
                f"{WHERE}: quantized experts run inference only, but autograd would record through them (the "
                f"tokens they receive require grad); call the layer under torch.no_grad() or "
                f"torch.inference_mode(), or train a layer whose experts hold the dequantized weights "
                f"(stack.dequantize_reference(dtype))")
        if getattr(ctx, "world_size", 1) > 1 and getattr(ctx, "adaptive_degree", 1) == 0:
            raise NotImplementedError(f"{WHERE}: adaptive_r=0 (every expert on every process) is not offered for "
                                      f"quantized experts; use adaptive_r=1")

    def _products(self, rows: torch.Tensor, ends) -> torch.Tensor:
        """[n, H] rows grouped by expert (expert e's end at ends[e]) -> [n, H] in rows' dtype."""
        stacks = self.stacks()
        # 16-bit biases widened once (exact), not on every call; others as they are
        biases = {name: self._float32.of(name, bias) for name, bias in (("up_bias", self.up_bias),
                                                                         ("down_bias", self.down_bias))
                  if bias is not None}
        return quantized_expert_products(rows, ends, stacks["up"], stacks["down"], gate_weight=stacks.get("gate"),
                                         unit=None if self._gate_fn is not None else self.unit,
                                         gate_fn=self._gate_fn, activations=self.activations, **biases)

    def _compute(self, h: torch.Tensor, group_rows: Optional[Sequence[int]]) -> torch.Tensor:
        """[L, C, H] slots (group_rows None), or [N, H] rows with group_rows[e] rows of expert e."""
        if group_rows is None:
            experts, capacity = h.shape[0], h.shape[1]
            rows = h.reshape(experts * capacity, h.shape[2])
            if h.device.type == "cpu":
                ends = [capacity * (e + 1) for e in range(experts)]
            else:  # made on the device: nothing copied from the host during a CUDA graph's capture
                ends = torch.arange(capacity, capacity * (experts + 1), capacity, dtype=torch.int32, device=h.device)
            out = self._products(rows, ends)
            return out.view(experts, capacity, out.shape[-1])
        ends, end = [], 0
        for count in group_rows:
            end += int(count)
            ends.append(end)
        return self._products(h, ends)

    def forward(self, x: torch.Tensor, ctx) -> torch.Tensor:
        """x [L, C, *features] slots of the local experts -> their outputs, of x's shape."""
        self._check_call(x, ctx)
        return run_padded(x, ctx, self._compute, self.model_dim, self.model_dim)

    def forward_grouped(self, x: torch.Tensor, group_rows, ctx) -> torch.Tensor:
        """x: [N, *features] rows grouped by local expert (group_rows[e] rows each) -> same shape."""
        self._check_call(x, ctx)
        y = self._compute(flatten_features(x, self.model_dim, self.model_dim, batch_dims=1), group_rows)
        return y.view(x.shape) if x.dim() > 2 else y

    offers_grouped_products = True

    def grouped_products(self, ctx, dtype: torch.dtype) -> Tuple[Callable, int]:
        """``(run, row_bytes)`` for the grouped paths without autograd (tutel.paths): ``run(rows,
        plan)`` computes every grouped row's expert; `row_bytes` is one row's up projection as the
        products compute it (projection_row_bytes)."""
        width = self._templates["up"].out_features * (2 if "gate" in self._templates else 1)

        def run(rows: torch.Tensor, plan) -> torch.Tensor:
            self._check_call(rows, ctx)
            return self._products(rows, plan.offsets)

        return run, projection_row_bytes(width, dtype, self.activations)


ExpertModule = QuantizedSwiGLUExperts
