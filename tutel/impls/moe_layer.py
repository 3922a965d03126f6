"""The MoE layer: ``tutel.moe.moe_layer`` (class ``MOELayer``).

A call is validated once (tutel.impls.call_settings), described by its facts and given a path by
tutel.rules.paths, and run by tutel.impls.layer_paths, whose paths return what they computed.
"""
import math
import os
import warnings
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

import torch

from ..collectives import get_world_size
from ..experts.quantize_float import quantize_experts
from ..experts.shared import pop_shared_experts
from ..ops.checks import require_int
from ..rules.autocast import any_autocast, autocast_dtype
from ..rules.paths import PathChoice
from ..rules.placement import Placement, global_expert_count, local_expert_count, pop_local_expert_count
from .call_context import LayerResult
from .call_plans import forget_plans, plan_call
from .call_settings import require_layer_input, resolve_switches
from .config_agreement import check_same_configuration
from .layer_config import build_experts, build_gate, gate_configs, parse_parallel_type, reject_unknown_layer_arguments, \
    valid_adaptive_rs
from .layer_paths import choose_layer_path, run_path
from .state_loading import load_moe_state, register_placement_record


def _default_group(group):
    if group is not None:
        return group
    import torch.distributed as dist
    return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None


class MOELayer(torch.nn.Module):
    """A Mixture-of-Experts layer with Tutel's API.

    Args:
        gate_type: a gate dict ``{'type': 'top', 'k': 2, 'capacity_factor': 1.0, 'gate_noise': 0.0,
            'fp32_gate': False}`` (or 'cosine_top', or 'custom' with 'module'), a list of them (pick one
            per call with ``forward(gate_index=i)``), or a legacy 'Top<K>Gate' string.  Dicts are
            copied, never modified.
        model_dim: size of a token's features (the product of the last ``reserve_dims`` input dims).
        experts: ``{'type': 'ffn', 'num_experts_per_device': L, 'hidden_size_per_expert': H, ...}``
            (or 'llama_ffn', 'clamped_swiglu', or 'custom' with 'module'); ``count_per_node`` is
            accepted for ``num_experts_per_device``; a negative count -n shares each expert over n
            processes; ``'shared_experts': {'hidden_size': I, 'gated': False}`` adds always-on
            shared experts (tutel.experts.shared).  Gate dicts also take the scored-routing options
            of docs/routing.md (score_function, selection_bias, n_group, ...).
        scan_expert_func: ``fn(name, param)`` called on every expert parameter.
        result_func: if given, forward returns ``result_func(output)``.
        group: process group of the expert-parallel exchange (default: WORLD).
        seeds: ``(gate_seed, expert_seed[, after_seed])`` for reproducible initialisation.
        a2a_ffn_overlap_degree: default number of chunks pipelining the exchange with expert compute.
        is_postscore: apply gate weights when combining (True) or when dispatching (False).
        batch_prioritized_routing: tokens with higher top-1 scores claim expert slots first.
        normalize_gate: for k > 1, rescale each token's k gate values to sum to 1.
        is_gshard_loss: auxiliary loss = GShard loss (True) or importance + load loss (False).
        parallel_type: default ``adaptive_r``: 'adaptive:<r>', 'data', 'model' or 'auto'.
        use_2dh: use the two-level (intra-node, inter-node) all-to-all.
    """

    def __init__(self, gate_type, model_dim: int, experts: Optional[Dict[str, Any]] = None,
                 scan_expert_func: Optional[Callable[[str, torch.nn.Parameter], Any]] = None,
                 result_func: Optional[Callable[[torch.Tensor], Any]] = None, group=None,
                 seeds: Optional[Sequence[Optional[int]]] = None, a2a_ffn_overlap_degree: int = 1,
                 is_postscore: bool = True, batch_prioritized_routing: bool = False,
                 normalize_gate: bool = True, is_gshard_loss: bool = True,
                 parallel_type: str = "adaptive:1", use_2dh: bool = False, **kwargs):
        super().__init__()
        reject_unknown_layer_arguments(kwargs)
        self.model_dim = require_int(model_dim, "model_dim", "moe_layer", minimum=1)
        if not isinstance(experts, dict):
            raise ValueError("moe_layer needs `experts`: a dict such as {'type': 'ffn', "
                             "'num_experts_per_device': 2, 'hidden_size_per_expert': 1024}")
        experts = dict(experts)
        gates = gate_configs(gate_type)
        shared_experts = pop_shared_experts(experts, self.model_dim)

        self.group = _default_group(group)
        self.result_func = result_func
        self.skip_moe = int(os.environ.get("SKIP_MOE", "0")) != 0
        self.world_size = get_world_size(self.group)

        self.num_local_experts = pop_local_expert_count(experts)
        # A Python int for the layer's own use (traceable by torch.compile; a plain attribute, read
        # at every call) and Tutel's buffer, which puts the count into state_dict.
        self.num_global_experts = global_expert_count(self.num_local_experts, self.world_size)
        self.register_buffer("_num_global_experts", torch.tensor(self.num_global_experts))
        placement = Placement(self.num_global_experts, self.world_size)
        self.sharded_count, self.num_local_experts = placement.sharded_count, placement.local_experts
        self.valid_rs = valid_adaptive_rs(self.sharded_count)
        self.adaptive_degree = parse_parallel_type(parallel_type, self.sharded_count)
        # Kept for code that reads Tutel's attributes; the layer never auto-selects.
        self.auto_parallel, self.use_model_parallel = False, True

        self.is_postscore = bool(is_postscore)
        self.batch_prioritized_routing = bool(batch_prioritized_routing) or int(os.environ.get("BATCH_PRIO", 0)) != 0
        self.normalize_gate = bool(normalize_gate)
        self.is_gshard_loss = bool(is_gshard_loss)
        self.a2a_ffn_overlap_degree = require_int(a2a_ffn_overlap_degree, "a2a_ffn_overlap_degree", "moe_layer", 1)
        self.use_2dh = bool(use_2dh)
        self.megablocks_size = 0
        self.l_aux = None

        if seeds is not None and len(seeds) > 1 and seeds[1] is not None:
            torch.manual_seed(seeds[1])
        self.experts = build_experts(experts, self.model_dim, self.num_local_experts, self.sharded_count)
        for name, param in self.experts.named_parameters():
            if scan_expert_func is not None:
                scan_expert_func(name, param)
            param._tutel_expert = True
        self.shared_experts = shared_experts  # replicated on every process, not expert-parallel

        built_gates = []
        for index, config in enumerate(gates):
            if seeds is not None and len(seeds) > 0 and seeds[0] is not None:
                torch.manual_seed(seeds[0] + index)
            built_gates.append(build_gate(config, self.model_dim, self.num_global_experts))
        self.gates = torch.nn.ModuleList(built_gates)
        register_placement_record(self)  # state_dict() records which process saved the experts
        if seeds is not None and len(seeds) > 2 and seeds[2] is not None:
            torch.manual_seed(seeds[2])
        if self.world_size > 1:
            check_same_configuration(self)

    # ------------------------------------------------------------------ Tutel API helpers

    @staticmethod
    def global_expert_count(num_local_experts, group=None) -> int:
        """Total experts when every process of `group` holds `num_local_experts`."""
        return global_expert_count(local_expert_count(num_local_experts), get_world_size(_default_group(group)))

    def extra_repr(self) -> str:
        return "Top-K(s) = %s, Total-Experts = %d [managed by %d device(s)]," % (
            [f"k={gate.top_k}, noise={gate.gate_noise}" for gate in self.gates],
            self.num_global_experts, self.world_size)

    def get_parameter_iterator(self, param_type: str):
        """named_parameters() of the gates ('gate') or of the local experts ('local_experts')."""
        if param_type == "gate":
            return self.gates.named_parameters()
        if param_type == "local_experts":
            return self.experts.named_parameters()
        raise ValueError(f"Specified parameter type is not recognized: {param_type!r}. "
                         f"Valid `param_type` includes: gate, local_experts.")

    def expert_local(self, x: torch.Tensor, reserve_shape: Sequence[int]) -> torch.Tensor:
        """Runs the local experts on x [L, tokens, feature] viewed as [L, tokens, *reserve_shape];
        returns [L, tokens, -1] and records the experts' output shape in ``protected_shape`` (Tutel's
        method: the experts get the layer itself as ``ctx``)."""
        y = self.run_local_experts(x, reserve_shape, self)
        self.protected_shape = y.shape
        return y.reshape(y.size(0), y.size(1), math.prod(y.shape[2:]))

    def run_local_experts(self, x: torch.Tensor, reserve_shape: Sequence[int], ctx: Any) -> torch.Tensor:
        """The local experts on x [L, tokens, feature] viewed as [L, tokens, *reserve_shape], called
        with `ctx` (the call's tutel.impls.call_context.CallContext); returns their output as they
        shape it, [L, tokens, *features]."""
        return self.experts(x.view(x.size(0), x.size(1), *reserve_shape), ctx)

    def update_selection_bias(self) -> int:
        """Aux-loss-free balancing step for every gate with ``selection_bias=True``: moves its bias by
        ``rate * sign(mean load - load)`` from the routed choices counted in training calls since the
        last update, summed over ``self.group`` (every process must call it, after optimizer.step()).
        Returns the number of gates updated.  ``tutel.moe.update_selection_biases(model)`` calls it
        for every layer of a model."""
        updated = 0
        for gate in self.gates:
            bias = getattr(gate, "selection_bias", None)
            if bias is not None:
                bias.update(self.group)
                updated += 1
        return updated

    def quantize_experts(self, format: str, **options: Any) -> "MOELayer":
        """Replaces the layer's float experts (``llama_ffn`` or ``clamped_swiglu``) by quantized ones
        (tutel.experts.quantized_swiglu) holding their matrices in `format` ("fp8_block", "mxfp4" or
        "nvfp4"), in place; the float experts are released.  `options`: ``activations``
        ("weight_only", or "dynamic" for "fp8_block") and the format's own (``block``,
        ``scale_dtype`` for "fp8_block").  The layer then runs inference only, on the CPU or CUDA.  Returns
        the layer.  Raises ValueError / TypeError (tutel.experts.quantize_float) leaving it unchanged."""
        self.experts = quantize_experts(self.experts, format, **options)
        forget_plans(self)
        return self

    def _apply(self, fn, *args, **kwargs):
        forget_plans(self)  # (the plans hold no parameter, but a moved layer starts afresh)
        return super()._apply(fn, *args, **kwargs)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        forget_plans(self)
        load_moe_state(self, state_dict, prefix, args[0] if args else None)  # args[0]: local_metadata
        return super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    # ------------------------------------------------------------------ forward

    def forward(self, input: torch.Tensor, gate_index: int = 0, capacity_factor: Optional[float] = None,
                top_k: Optional[int] = None, a2a_ffn_overlap_degree: Optional[int] = None,
                reserve_dims: int = 1, inequivalent_tokens: bool = False, adaptive_r: Optional[int] = None,
                megablocks_size: int = 0):
        """Routes every token of `input` to its top-k experts and combines their outputs.

        Every switch applies to this call only (the constructor's values are the defaults):

        Args:
            input: [..., *features] with at least 2 dims; the last ``reserve_dims`` dims (product =
                model_dim) are one token's features.
            gate_index: which gate of the list to use.
            capacity_factor: None = the gate's; > 0 static capacity; 0 dropless (no token dropped);
                < 0 dynamic capacity capped at -capacity_factor.
            top_k: None = the gate's k; else 1 <= top_k <= num_global_experts.
            a2a_ffn_overlap_degree: chunks pipelining the expert exchange with expert compute.
            reserve_dims: trailing dims forming a token.
            inequivalent_tokens: processes may hold different token counts.  Accepted for Tutel
                compatibility: processes always agree on the largest capacity (see
                tutel.impls.call_agreement), so different token counts work either way.
            adaptive_r: parallelism of shared experts (0, or a divisor of the shard count).
            megablocks_size: > 0 computes each expert only over its occupied rows, in blocks of this size.

        Returns:
            Tensor of shape input.shape[:-reserve_dims] + expert_output_features, in the input's dtype,
            with the auxiliary loss attached as ``.l_aux`` (also ``self.l_aux``); or result_func(output).
        """
        output, _ = self.forward_with_result(input, gate_index, capacity_factor, top_k, a2a_ffn_overlap_degree,
                                             reserve_dims, inequivalent_tokens, adaptive_r, megablocks_size)
        return self.result_func(output) if self.result_func is not None else output

    def forward_with_result(self, input: torch.Tensor, gate_index: int = 0, capacity_factor: Optional[float] = None,
                            top_k: Optional[int] = None, a2a_ffn_overlap_degree: Optional[int] = None,
                            reserve_dims: int = 1, inequivalent_tokens: bool = False,
                            adaptive_r: Optional[int] = None, megablocks_size: int = 0
                            ) -> Tuple[torch.Tensor, Optional[LayerResult]]:
        """forward's output (without result_func) and what its path computed (the routing weights and
        the gate's logits among it; None with SKIP_MOE).  The arguments are forward's."""
        if self.skip_moe:
            output = input.view(input.shape)
            output.l_aux = self.l_aux = None
            return output, None
        reserve_dims, call, dtype, choice = plan_call(self, input, gate_index, capacity_factor, top_k,
                                                      a2a_ffn_overlap_degree, reserve_dims, adaptive_r, megablocks_size)
        reserve_shape = input.shape[-reserve_dims:]
        x = input.reshape(-1, self.model_dim)
        if x.dtype != dtype:
            x = x.to(dtype)
        # A sequence (for the sequence-wise balance loss) is the dim before the token's features.
        sequence_length = input.shape[-reserve_dims - 1] if input.dim() > reserve_dims + 1 else x.shape[0]
        result = run_path(choice.path, self, x, call, reserve_shape, sequence_length, inequivalent_tokens)
        y = result.output
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        features = list(result.features[-reserve_dims:])
        output = y.view(list(input.shape[:-reserve_dims]) + features)
        if output.dtype != input.dtype:
            output = output.to(input.dtype)
        output.l_aux = result.l_aux
        # The loss and Tutel's record of the last call (for code that reads it; nothing in tutel
        # does): plain attributes, set in one go rather than through nn.Module.__setattr__, whose
        # checks for parameters, buffers and submodules cost as much as a small call's routing.
        self.__dict__.update(l_aux=result.l_aux, dispatch_count=result.dispatch_count,
                             local_dispatch_count=result.dispatch_count, megablocks_size=call.megablocks_size,
                             protected_shape=torch.Size([y.shape[0], *features]))
        return output, result

    def choose_path(self, input: torch.Tensor, **switches: Any) -> PathChoice:
        """The path a call ``layer(input, **switches)`` takes, and why (tutel.rules.paths), without
        running it.  Arguments and errors are forward's."""
        where = "moe_layer.forward"
        reserve_dims = require_layer_input(self, input, switches.pop("reserve_dims", 1), where)
        switches.pop("inequivalent_tokens", None)
        call = resolve_switches(self, where, tokens=input.numel() // self.model_dim, **switches)
        x = input.reshape(-1, self.model_dim)
        return choose_layer_path(self, x.to(self._compute_dtype(x, warn=False)), call, reserve_dims)

    def _compute_dtype(self, x: torch.Tensor, warn: bool = True, stacklevel: int = 4) -> torch.dtype:
        """Autocast's dtype when autocast is on, else the experts' parameter dtype (else x's).

        Tokens of another floating dtype than the experts' parameters are computed in the
        parameters' dtype, as Tutel does, with a warning (once per pair of dtypes): float64 tokens
        through a float32 layer are not computed in float64 (docs/migration.md)."""
        dtype = autocast_dtype(x.device.type) if any_autocast() else None
        if dtype is not None:
            return dtype
        # The experts' own parameters first: parameters() yields them first anyway, and walking the
        # module tree for them costs tens of microseconds per call, a decoding step's scale.
        for params in (self.experts._parameters.values(), self.experts.parameters()):
            for param in params:
                if param is not None and param.is_floating_point():
                    if warn and param.dtype != x.dtype:
                        warnings.warn(f"moe_layer: the input is {x.dtype} but the experts' parameters are "
                                      f"{param.dtype}; the layer computes in {param.dtype} and returns "
                                      f"{x.dtype} (as Tutel does). Convert the layer (e.g. layer.to({x.dtype})) "
                                      f"to compute in {x.dtype}.", UserWarning, stacklevel=stacklevel)
                    return param.dtype
        return x.dtype


moe_layer = MOELayer
