"""One call's arguments and what its stages hand each other (the ``Work`` a path runs on), and the
experts a call computes with (``WeightExperts``: tensors given to routed_experts; ``QuantizedExperts``:
quantized stacks given to routed_quantized_experts; ``ModuleExperts``: moe_layer's experts module with
the call's context)."""
from typing import Any, Callable, NamedTuple, Optional, Sequence, Tuple

import torch

from ..ops.gated_units import SWIGLU, GatedUnit, apply_gated_unit
from ..ops.grouped_mm import bias_costs_a_launch, grouped_rows_mm, grouped_rows_mm_eager
from ..ops.quantized_experts import (WEIGHT_ONLY, QuantizedDecodeForm, decode_form, decode_quantized_products,
                                     projection_row_bytes, quantized_expert_products)
from ..ops.tracing import eager_without_grad


# QuantizedExperts' decode form before anyone asked for it (None means the operator cannot take them).
NOT_ASKED = object()  # a QuantizedExperts' decode form not found yet


class GatedWeights(NamedTuple):
    """The matrices of gated experts as the one-call and decode operators take them."""
    up_weight: torch.Tensor             # [E, U, H] (or [E, H, U] transposed); the ups only with gate_weight
    down_weight: torch.Tensor           # [E, O, I] (or [E, I, O])
    gate_weight: Optional[torch.Tensor]  # the gates' own matrices, of up_weight's shape, or None
    up_bias: Optional[torch.Tensor]
    down_bias: Optional[torch.Tensor]
    transposed: bool
    unit: GatedUnit


class WeightExperts:
    """routed_experts' experts: the weight tensors and the rule between the two products.  Called
    as ``experts(rows, plan)`` it maps [n, H] rows grouped as `plan` (tutel.paths.plans.RoutingPlan)
    says to their [n, O] outputs before the routing weights.  (A plain class, not a NamedTuple:
    PyTorch 2.6's torch.compile cannot call a method of a tuple that holds tensors.)"""
    __slots__ = ("up_weight", "down_weight", "up_bias", "down_bias", "transposed", "unit", "gate_fn", "activation",
                 "post_fn", "gate_weight", "num_experts")

    def __init__(self, up_weight: torch.Tensor, down_weight: torch.Tensor, up_bias: Optional[torch.Tensor],
                 down_bias: Optional[torch.Tensor], transposed: bool, unit: Optional[GatedUnit],
                 gate_fn: Optional[Callable[[torch.Tensor], torch.Tensor]],
                 activation: Optional[Callable[[torch.Tensor], torch.Tensor]],
                 post_fn: Optional[Callable[[torch.Tensor], torch.Tensor]]):
        self.up_weight, self.down_weight, self.up_bias, self.down_bias = up_weight, down_weight, up_bias, down_bias
        self.transposed, self.unit, self.gate_fn, self.activation, self.post_fn = \
            transposed, unit, gate_fn, activation, post_fn
        self.gate_weight = None  # (GatedWeights' fields: the gates ride in up_weight)
        self.num_experts = up_weight.shape[0]

    def with_weights(self, up_weight: torch.Tensor, down_weight: torch.Tensor) -> "WeightExperts":
        """The same experts with their matrices converted (autocast, widening)."""
        return WeightExperts(up_weight, down_weight, self.up_bias, self.down_bias, self.transposed, self.unit,
                             self.gate_fn, self.activation, self.post_fn)

    def gated(self, dtype: torch.dtype) -> "WeightExperts":
        """The gated experts' matrices (already in the call's dtype): this object, which has
        GatedWeights' fields."""
        return self

    def grouped_products(self, dtype: torch.dtype) -> Tuple[Callable, int]:
        """``(products, row_bytes)``: the experts on grouped rows (this object), and one row's up
        projection in bytes."""
        up = self.up_weight
        return self, (up.shape[2] if self.transposed else up.shape[1]) * up.element_size()

    def __call__(self, rows: torch.Tensor, plan, product: Optional[Callable] = None) -> torch.Tensor:
        """The rows past the kept ones hold anything (the combine and the pieces read only the kept
        rows, and their gradients flow back only into them).  The biases ride in the grouped
        products, except a gated unit's up bias where the product would add it in a launch of its
        own (beside grouped_mm, on devices): the unit's kernel adds it instead.  `product` replaces
        grouped_rows_mm (same arguments; tutel.paths.experts_per_expert's adds the biases itself)."""
        unit_bias = self.up_bias if product is None and self.unit is not None and self.up_bias is not None and \
            bias_costs_a_launch(rows, self.up_weight, self.transposed) else None
        eager = None
        if product is None:
            # Both products and the unit without the custom operators where nothing records or traces
            # (asked once).
            eager = eager_without_grad(rows, self.up_weight, self.down_weight, self.up_bias, self.down_bias)
            product = grouped_rows_mm_eager if eager else grouped_rows_mm
        hidden = product(rows, self.up_weight, plan.offsets, self.transposed,
                         self.up_bias if unit_bias is None else None, zero_tail=False)
        if self.unit is not None:
            hidden = apply_gated_unit(hidden, self.unit, None if unit_bias is None else unit_bias.to(hidden.dtype),
                                      None if unit_bias is None else plan.offsets, eager)
        elif self.gate_fn is not None:
            hidden = self.gate_fn(hidden)
        else:
            hidden = self.activation(hidden)
        if hidden.dtype != self.down_weight.dtype:
            hidden = hidden.to(self.down_weight.dtype)
        out = product(hidden, self.down_weight, plan.offsets, self.transposed, self.down_bias, zero_tail=False)
        return out if self.post_fn is None else self.post_fn(out)


class QuantizedExperts:
    """routed_quantized_experts' experts: tutel.quant stacks, their optional biases and the rule
    between the two products.  They offer ``grouped_products`` as WeightExperts do, so they run on
    the experts entry's stages (the one-call operator and the CUDA decode kernels do not take them:
    ``gated_experts`` and ``decode_kernel`` do not hold); called as ``experts(rows, plan)`` they map
    [n, H] rows grouped as `plan` says to their [n, O] outputs (tutel.ops.quantized_experts: tutel's
    quantized_grouped_linear over the rows, on the CPU or CUDA).  At decoding sizes ``decode(x, expert_ids, weights)``
    runs them in one call of tutel's decode_quantized_experts operator, where ``decode_form()``
    is not None (the ``quantized_decode`` fact)."""
    __slots__ = ("up", "down", "gate_weight", "unit", "gate_fn", "activation", "activations", "num_experts",
                 "up_bias", "down_bias", "_decode_form")

    def __init__(self, up, down, gate_weight=None, unit: Optional[GatedUnit] = None,
                 gate_fn: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
                 activation: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
                 activations: str = WEIGHT_ONLY, up_bias: Optional[torch.Tensor] = None,
                 down_bias: Optional[torch.Tensor] = None, decode_form: object = NOT_ASKED):
        self.up, self.down, self.gate_weight = up, down, gate_weight  # tutel.quant stacks (gate_weight or None)
        self.unit, self.gate_fn, self.activation, self.activations = unit, gate_fn, activation, activations
        self.up_bias, self.down_bias = up_bias, down_bias  # [E, U] ([gate | up] with gate_weight), [E, O], or None
        self.num_experts = up.experts
        self._decode_form = decode_form  # found by an earlier call on the same experts, or NOT_ASKED

    def decode_form(self) -> Optional[QuantizedDecodeForm]:
        """How the decode operator takes these experts, or None where it cannot (found on the first
        question, then kept: the experts do not change)."""
        form = self._decode_form
        if form is NOT_ASKED:
            form = self._decode_form = decode_form(self.up, self.down, self.gate_weight, self.unit, self.gate_fn,
                                                   self.activation, self.activations)
        return form

    def grouped_products(self, dtype: torch.dtype) -> Tuple[Callable, int]:
        """``(products, row_bytes)``: the experts on grouped rows (this object), and one row's up
        projection in bytes as the products compute it (projection_row_bytes)."""
        width = self.up.out_features * (1 if self.gate_weight is None else 2)
        return self, projection_row_bytes(width, dtype, self.activations)

    def __call__(self, rows: torch.Tensor, plan, product: Optional[Callable] = None) -> torch.Tensor:
        """The rows past the plan's last group end give zeros; `product` is not taken (the products
        dequantize each expert's matrices themselves)."""
        return quantized_expert_products(rows, plan.offsets, self.up, self.down, gate_weight=self.gate_weight,
                                         unit=self.unit, gate_fn=self.gate_fn, activation=self.activation,
                                         activations=self.activations, up_bias=self.up_bias,
                                         down_bias=self.down_bias)

    def decode(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: Optional[torch.Tensor]) -> torch.Tensor:
        """The [T, O] weighted sum of the tokens' experts by the decode operator (decode_form() must
        not be None; x on the CPU or CUDA, of tutel.ops.quantized_experts.DECODE_DTYPES)."""
        return decode_quantized_products(x, expert_ids, weights, self.up, self.down, self.decode_form(),
                                         self.up_bias, self.down_bias)


class ModuleExperts:
    """moe_layer's experts module for one call: `ctx` is the call's context (tutel.impls.call_context)."""

    def __init__(self, layer: torch.nn.Module, ctx: Any, reserve_shape: Sequence[int]):
        self.layer, self.ctx, self.reserve_shape = layer, ctx, reserve_shape
        self.num_experts = layer.num_global_experts

    def gated(self, dtype: torch.dtype) -> GatedWeights:
        """The SwiGLU experts' three matrices in `dtype` ([E, H, I] each, the gates' apart)."""
        gate_w, up_w, down_w = self.layer.experts.gated_weights(self.ctx, dtype)
        return GatedWeights(up_w, down_w, gate_w, None, None, True, SWIGLU)

    def grouped_products(self, dtype: torch.dtype) -> Tuple[Callable, int]:
        """The module's ``grouped_products(ctx, dtype)``: ``(products, row_bytes)``."""
        return self.layer.experts.grouped_products(self.ctx, dtype)

    def padded(self, slots: torch.Tensor) -> torch.Tensor:
        """The local experts on an [L, C, M] slot buffer -> [L, C, *features]."""
        return self.layer.run_local_experts(slots, self.reserve_shape, self.ctx)

    def grouped(self, rows: torch.Tensor, group_rows: Sequence[int]) -> torch.Tensor:
        """The module's ``forward_grouped`` on [N, M] rows grouped by expert (group_rows[e] each)."""
        return self.layer.experts.forward_grouped(rows.view(rows.shape[0], *self.reserve_shape), group_rows,
                                                  self.ctx)


class Work:
    """One call of a path: what the caller gives (the tokens, the routing, the experts, the switches
    the stages read) and what the stages hand each other (the plan, the rows, the outputs).  A
    path's prepare, experts and finalize stages read and set its attributes in turn; ``y`` is the
    call's [T, O] result.  (Slots, not a dict: one is made per call.)"""
    __slots__ = ("x", "experts", "expert_ids", "weights", "crit", "routing", "at_combine", "dropless",
                 "megablocks_size", "ops", "dtype", "plan", "rows", "out", "y", "features")

    def __init__(self, x: torch.Tensor, experts, *, expert_ids: Optional[torch.Tensor] = None,
                 weights: Optional[torch.Tensor] = None, crit: Any = None, routing: Any = None,
                 at_combine: bool = True, dropless: bool = False, megablocks_size: int = 0, ops: Any = None):
        # attribute by attribute (a class, not a tuple): torch.compile traces every path through it
        self.x = x                    # [T, H] tokens in the compute dtype
        self.experts = experts        # WeightExperts or ModuleExperts
        self.expert_ids = expert_ids  # [T, k] chosen experts (ids outside [0, E) contribute nothing)
        self.weights = weights        # [T, k] routing weights, or None for 1
        self.crit = crit              # Tutel's crit tuple (the layer's routing), or None
        self.routing = routing        # tutel.ops.route_experts.ExpertRouting (planned paths), or None
        self.at_combine = at_combine  # the weights apply at the combine (else at the encode)
        self.dropless = dropless
        self.megablocks_size = megablocks_size
        # x's device's operators (tutel.ops.backend.operators_for) for a call nothing records or
        # traces, which the stages then call directly (no autograd functions); None otherwise
        self.ops = ops
        self.dtype = x.dtype          # the products' dtype (a CPU without 16-bit dot products widens)
        self.plan = None
        self.rows: Optional[torch.Tensor] = None
        self.out: Optional[torch.Tensor] = None
        self.y: Optional[torch.Tensor] = None
        self.features: Tuple[int, ...] = ()
