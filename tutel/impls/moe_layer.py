"""The MoE layer: ``tutel.moe.moe_layer`` (class ``MOELayer``)."""
import contextlib
import dataclasses
import math
import os
from typing import Any, Callable, Dict, Optional, Sequence

import torch
import torch.nn.functional as F

from ..collectives import get_world_size
from ..experts import run_grouped_experts, supports_grouped
from ..experts.shared import pop_shared_experts
from ..ops.checks import require_finite_number, require_int, require_tensor, require_top_k
from . import inference_path, losses
from .autocast import autocast_dtype, without_autocast
from .capacity import capacity_alignment, expert_capacity
from .call_agreement import agree_on_call
from .config_agreement import check_same_configuration
from .fast_dispatch import extract_critical, fast_decode, fast_encode, get_dispatch_count
from .layer_config import build_experts, build_gate, gate_configs, parse_parallel_type, reject_unknown_layer_arguments, \
    valid_adaptive_rs
from .placement import Placement, global_expert_count, local_expert_count, pop_local_expert_count
from .scored_routing import route_scored
from .state_loading import load_moe_state, register_placement_record


@dataclasses.dataclass(frozen=True)
class CallSettings:
    """One forward call's resolved switches (the call's arguments, or the layer's / gate's defaults)."""

    gate: torch.nn.Module
    top_k: int
    capacity_factor: float
    overlap: int          # a2a_ffn_overlap_degree
    adaptive_r: int
    megablocks_size: int  # 0 when the grouped path is off (or cannot run on several processes)


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
        # A Python int for the layer's own use (traceable by torch.compile) and Tutel's buffer,
        # which puts the count into state_dict.
        self._expert_count = global_expert_count(self.num_local_experts, self.world_size)
        self.register_buffer("_num_global_experts", torch.tensor(self._expert_count))
        placement = Placement(self._expert_count, self.world_size)
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

    @property
    def num_global_experts(self) -> int:
        return self._expert_count

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
        returns [L, tokens, -1] and records the experts' output shape in ``protected_shape``."""
        y = self.experts(x.view(x.size(0), x.size(1), *reserve_shape), self)
        self.protected_shape = y.shape
        return y.reshape(y.size(0), y.size(1), math.prod(y.shape[2:]))

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

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
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
        if self.skip_moe:
            output = input.view(input.shape)
            output.l_aux = self.l_aux = None
            return self.result_func(output) if self.result_func is not None else output

        where = "moe_layer.forward"
        call = self._call_settings(input, gate_index, capacity_factor, top_k, a2a_ffn_overlap_degree,
                                   reserve_dims, adaptive_r, megablocks_size, where)
        gate, overlap, megablocks_size = call.gate, call.overlap, call.megablocks_size
        original_shape, original_dtype = input.shape, input.dtype
        reserve_shape = original_shape[-reserve_dims:]

        x = input.reshape(-1, self.model_dim)
        x = x.to(self._compute_dtype(x))
        self.megablocks_size = megablocks_size
        fast = None
        if inference_path.covers(self, x, gate, call.capacity_factor, megablocks_size, reserve_dims):
            fast = inference_path.forward_without_grad(self, x, gate, call.top_k, call.capacity_factor, overlap,
                                                       megablocks_size)
        if fast is not None:
            y, l_aux = fast.output, fast.l_aux
            self.dispatch_count = self.local_dispatch_count = fast.dispatch_count
        else:
            y, l_aux = self._route_and_run_experts(input, x, gate, call, reserve_shape, inequivalent_tokens)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)

        output_shape = list(original_shape[:-reserve_dims]) + list(self.protected_shape[-reserve_dims:])
        output = y.view(output_shape).to(original_dtype)
        output.l_aux = self.l_aux = l_aux
        return self.result_func(output) if self.result_func is not None else output

    def _route_and_run_experts(self, input, x, gate, call, reserve_shape, inequivalent_tokens):
        """The general forward's routing and experts: (y [T, O], l_aux)."""
        overlap, adaptive_r, megablocks_size = call.overlap, call.adaptive_r, call.megablocks_size
        reserve_dims = len(reserve_shape)
        # A sequence (for the sequence-wise balance loss) is the dim before the token's features.
        sequence_length = input.shape[-reserve_dims - 1] if input.dim() > reserve_dims + 1 else x.shape[0]
        with without_autocast(x.device.type):
            crit, l_aux = self._route(x, gate, call.top_k, call.capacity_factor, overlap, megablocks_size,
                                      inequivalent_tokens, sequence_length)

        if self.world_size > 1:
            crit = crit._replace(capacity=agree_on_call(self.group, x.device, crit.capacity, overlap, adaptive_r))
        self.dispatch_count = get_dispatch_count(crit)
        self.local_dispatch_count = self.dispatch_count
        with self._per_call(adaptive_degree=adaptive_r, a2a_ffn_overlap_degree=overlap):
            if megablocks_size > 0 and supports_grouped(self.experts):
                # Dropless without padding: tokens go straight into the experts' grouped rows.
                y = run_grouped_experts(self, x, crit, reserve_shape, megablocks_size, self.is_postscore,
                                        dropless=call.capacity_factor == 0)
            else:
                y = fast_encode(x, crit, self.is_postscore)
                y = self._run_experts(y, reserve_shape, overlap, adaptive_r)
                y = fast_decode(y, crit, self.is_postscore)
        return y, l_aux

    def _call_settings(self, input, gate_index, capacity_factor, top_k, overlap, reserve_dims, adaptive_r,
                       megablocks_size, where) -> "CallSettings":
        """Validates one call's arguments and resolves the defaults."""
        require_tensor(input, "input", where)
        if not input.is_floating_point():
            raise TypeError(f"{where}: `input` must be a floating-point tensor, got {input.dtype}")
        if input.dim() < 2:
            raise ValueError(f"{where}: `input` must have at least 2 dims (tokens, ..., model_dim), "
                             f"got shape {tuple(input.shape)}")
        reserve_dims = require_int(reserve_dims, "reserve_dims", where, minimum=1)
        if reserve_dims >= input.dim():
            raise ValueError(f"{where}: reserve_dims={reserve_dims} is too large for a {input.dim()}-D input; "
                             f"allowed: 1 <= reserve_dims <= {input.dim() - 1}")
        features = math.prod(input.shape[-reserve_dims:])
        if features != self.model_dim:
            raise ValueError(f"{where}: the last {reserve_dims} dim(s) of `input` {tuple(input.shape)} hold "
                             f"{features} features but the layer's model_dim is {self.model_dim}")
        gate_index = require_int(gate_index, "gate_index", where, minimum=0)
        if gate_index >= len(self.gates):
            raise ValueError(f"{where}: gate_index={gate_index} is out of range; the layer has "
                             f"{len(self.gates)} gate(s) (allowed: 0..{len(self.gates) - 1})")
        gate = self.gates[gate_index]
        num_experts = self.num_global_experts
        if top_k is None:
            top_k = gate.top_k
        else:
            top_k = require_top_k(top_k, num_experts, where)
        if capacity_factor is None:
            capacity_factor = gate.capacity_factor
        capacity_factor = require_finite_number(capacity_factor, "capacity_factor", where)
        overlap = self.a2a_ffn_overlap_degree if overlap is None else \
            require_int(overlap, "a2a_ffn_overlap_degree", where, minimum=1)
        if adaptive_r is None:
            adaptive_r = self.adaptive_degree
        else:
            adaptive_r = require_int(adaptive_r, "adaptive_r", where, minimum=0)
            if adaptive_r not in self.valid_rs:
                raise ValueError(f"{where}: adaptive_r={adaptive_r} is not valid for {self.sharded_count} "
                                 f"process(es) per expert; allowed: {self.valid_rs}")
        if overlap > 1 and capacity_factor > 0:
            tokens = input.numel() // self.model_dim
            static_capacity = expert_capacity(capacity_factor, top_k, tokens, num_experts)
            if 0 < static_capacity < overlap:
                raise ValueError(f"{where}: a2a_ffn_overlap_degree={overlap} exceeds this call's capacity of "
                                 f"{static_capacity} slots per expert: the extra chunks would hold only padding; "
                                 f"allowed: 1 <= a2a_ffn_overlap_degree <= {static_capacity}")
        megablocks_size = require_int(megablocks_size, "megablocks_size", where, minimum=0)
        if megablocks_size > 0 and self.world_size > 1:
            megablocks_size = 0  # the grouped path needs every expert's load on this process
        return CallSettings(gate, top_k, capacity_factor, overlap, adaptive_r, megablocks_size)

    def _compute_dtype(self, x: torch.Tensor) -> torch.dtype:
        """Autocast's dtype when autocast is on, else the experts' parameter dtype (else x's)."""
        dtype = autocast_dtype(x.device.type)
        if dtype is not None:
            return dtype
        # The experts' own parameters first: parameters() yields them first anyway, and walking the
        # module tree for them costs tens of microseconds per call, a decoding step's scale.
        for params in (self.experts._parameters.values(), self.experts.parameters()):
            for param in params:
                if param is not None and param.is_floating_point():
                    return param.dtype
        return x.dtype

    def _route(self, x, gate, top_k, capacity_factor, overlap, megablocks_size, inequivalent_tokens,
               sequence_length):
        logits = gate(x)
        if logits.dim() != 2 or logits.shape != (x.shape[0], self.num_global_experts):
            raise ValueError(f"gate returned logits of shape {tuple(logits.shape)}; expected "
                             f"[tokens, num_global_experts] = [{x.shape[0]}, {self.num_global_experts}]")
        if self.training and gate.gate_noise > 0:
            noisy_logits = logits + gate.gate_noise * torch.randn_like(logits) / self.num_global_experts
        else:
            noisy_logits = logits
        options = getattr(gate, "routing_options", None)
        if options is not None and not options.is_default:
            return self._route_scored(gate, logits, noisy_logits, top_k, capacity_factor, overlap,
                                      megablocks_size, inequivalent_tokens, sequence_length)
        scores = F.softmax(noisy_logits, dim=1)
        if self.is_gshard_loss:
            loss_fn = losses.gshard_loss
        else:
            def loss_fn(_scores, topk_ids):
                return losses.load_importance_loss(
                    F.softmax(logits, dim=1), noisy_logits.gather(1, topk_ids), self.num_global_experts,
                    gate.gate_noise, logits_wo_noise=logits, noisy_logits=noisy_logits)
        return extract_critical(
            scores, top_k=top_k, loss_fn=loss_fn, capacity_factor=capacity_factor,
            batch_prioritized_routing=self.batch_prioritized_routing, normalize_gate=self.normalize_gate,
            alignment=capacity_alignment(self.sharded_count, overlap, megablocks_size), group=self.group,
            inequivalent_tokens=inequivalent_tokens)

    def _route_scored(self, gate, logits, noisy_logits, top_k, capacity_factor, overlap, megablocks_size,
                      inequivalent_tokens, sequence_length):
        """Routing under the gate's scored-routing options (tutel.impls.scored_routing); in training
        it also counts the choices each expert received for the selection-bias update."""
        bias = getattr(gate, "selection_bias", None)
        crit, l_aux = route_scored(
            logits, noisy_logits, gate.routing_options, None if bias is None else bias.bias, top_k,
            gate_noise=gate.gate_noise, is_gshard_loss=self.is_gshard_loss, normalize_gate=self.normalize_gate,
            sequence_length=sequence_length, capacity_factor=capacity_factor,
            batch_prioritized_routing=self.batch_prioritized_routing,
            alignment=capacity_alignment(self.sharded_count, overlap, megablocks_size), group=self.group,
            inequivalent_tokens=inequivalent_tokens)
        if bias is not None and self.training:
            bias.record(crit.dispatch_count)
        return crit, l_aux

    @contextlib.contextmanager
    def _per_call(self, **values):
        """Exposes this call's settings as attributes (experts read ``ctx.adaptive_degree``) and
        restores the defaults afterwards, so per-call switches never stick."""
        saved = {name: getattr(self, name) for name in values}
        try:
            for name, value in values.items():
                setattr(self, name, value)
            yield
        finally:
            for name, value in saved.items():
                setattr(self, name, value)

    def _run_experts(self, y: torch.Tensor, reserve_shape, overlap: int, adaptive_r: int) -> torch.Tensor:
        """[E, C, M] dispatched tokens -> [E, C, M'] expert outputs."""
        if self.world_size == 1:
            return self.expert_local(y, reserve_shape)
        from .expert_parallel import run_experts_distributed
        return run_experts_distributed(self, y, reserve_shape, overlap, adaptive_r)


moe_layer = MOELayer
