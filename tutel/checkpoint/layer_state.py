"""The checkpoint hooks an MoE layer calls on itself: recording which process saved its experts,
and fitting a loaded checkpoint's expert tensors to this process.

The layer calls these; this module never imports the layer (it reads only the attributes
``group``, ``world_size``, ``num_global_experts`` and ``experts``), so there is no import circle.
"""
import math
from typing import Dict, Mapping, Optional

import torch

from ..collectives import get_world_rank
from ..rules.placement import Placement
from .layouts import ShapeError, layout_of
from .reshard import ExpertTensors, layer_name, stored_for_rank
from .state_dicts import EXPERTS, PLACEMENT_KEY, record_placement

RESHARD_HINT = ("a checkpoint saved by another number of processes loads with "
                "tutel.checkpoint.load_resharded(model, pattern, saved_world_size)")


def layer_rank(layer) -> int:
    """The layer's rank in its expert-parallel group."""
    return get_world_rank(layer.group) if layer.world_size > 1 else 0


def expert_full_sizes_of(experts: torch.nn.Module) -> Dict[str, int]:
    """Sizes of one whole expert that the stored slices do not tell: ffn's output_dim (fc2 bias)
    and llama_ffn's flat weights (from ``full_shapes``)."""
    sizes = {name: math.prod(shape[1:]) for name, shape in getattr(experts, "full_shapes", {}).items()}
    if getattr(experts, "batched_fc2_bias", None) is not None:
        sizes["batched_fc2_bias"] = int(experts.output_dim)
    return sizes


def record_placement_on_save(layer, state_dict, prefix: str, local_metadata) -> None:
    """state_dict post-hook of moe_layer: records which process of how many saved its experts."""
    record_placement(local_metadata, layer_rank(layer), layer.world_size)


def register_placement_record(layer) -> None:
    """Makes `layer.state_dict()` record its placement (public hook API where torch has it)."""
    register = getattr(layer, "register_state_dict_post_hook", None) or layer._register_state_dict_hook
    register(record_placement_on_save)


def _check_recorded_placement(layer, key_prefix: str, local_metadata: Optional[Mapping]) -> bool:
    """Refuses experts saved by another process; True when the record says 'global form'."""
    record = (local_metadata or {}).get(PLACEMENT_KEY)
    if not record:
        return False
    saved_rank, saved_world = int(record["rank"]), int(record["world_size"])
    rank, world = layer_rank(layer), layer.world_size
    if saved_world == world and saved_rank != rank:
        raise ValueError(f"Failed to load MoE layer {layer_name(key_prefix)}: the checkpoint holds the experts of rank "
                         f"{saved_rank} of {saved_world}, but this process is rank {rank} (load each rank's own "
                         f"file)")
    if saved_world not in (1, world):
        raise ValueError(f"Failed to load MoE layer {layer_name(key_prefix)}: the checkpoint was saved by rank {saved_rank} "
                         f"of {saved_world} processes and this layer runs on {world}; {RESHARD_HINT}")
    return saved_world == 1 and world > 1


def local_expert_state(layer, state_dict, prefix: str, local_metadata: Optional[Mapping] = None) -> None:
    """Fits the checkpoint's expert tensors of `layer` to this process, in place of `state_dict`.

    Each tensor may be this process's own (or any tensor with its number of elements, which
    Tutel's loader viewed to the layer's shape) or the global form holding all experts, from
    which this process's experts are cut.  Anything else raises ValueError naming the
    parameter, the checkpoint's shape and the shapes that would fit."""
    is_global = _check_recorded_placement(layer, prefix, local_metadata)
    placement = Placement(layer.num_global_experts, layer.world_size)
    sizes = expert_full_sizes_of(layer.experts)
    forms = {}
    for name, param in layer.experts.named_parameters():
        key = prefix + EXPERTS + name
        if key not in state_dict:
            continue
        value = state_dict[key]
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"Failed to load `{key}`: the checkpoint holds a {type(value).__name__}, not a tensor")
        layout = layout_of(name, param)
        global_shape = layout.global_shape(tuple(param.shape), placement, sizes.get(name))
        if value.numel() == param.numel() and not is_global:
            forms[key] = "local"
            if value.shape != param.shape:
                state_dict[key] = value.reshape(param.shape)
        elif value.numel() == math.prod(global_shape) and (placement.world_size > 1 or is_global):
            forms[key] = "global"
            what = f"`{key}`"
            experts = layout.split_experts(value.reshape(global_shape), placement.num_experts, what)
            state_dict[key] = stored_for_rank(ExpertTensors(layout, dict(enumerate(experts))), what, placement,
                                              layer_rank(layer))
        else:
            fits = (f"the layer's shape {tuple(param.shape)}" if placement.world_size == 1 else
                    f"neither this process's shape {tuple(param.shape)} nor the layer's global shape {global_shape} "
                    f"({placement.num_experts} experts over {placement.world_size} processes)")
            raise ShapeError(f"Failed to load `{key}`: checkpoint shape {tuple(value.shape)} ({value.numel()} "
                             f"elements) does not fit {fits}; {RESHARD_HINT}")
    if len(set(forms.values())) > 1:
        raise ShapeError(f"Failed to load MoE layer {layer_name(prefix)}: some expert tensors hold all experts "
                         f"({[k for k, f in forms.items() if f == 'global']}) and others one process's share "
                         f"({[k for k, f in forms.items() if f == 'local']})")
