"""Loading checkpoints into MoE layers whose world size differs from the one that saved them.

* ``moe_layer.load_state_dict`` accepts a gathered (global-form) checkpoint: each process
  keeps its own experts (``local_expert_state`` below, called from the layer).
* ``load_resharded(model, pattern, saved_world_size)`` loads the per-rank files of N
  processes into a model running on M processes, reading only the files that hold this
  process's experts.
"""
import math
from typing import Dict, Mapping, Optional

import torch

from .files import rank_files, read_states
from .layouts import ShapeError, layout_of
from ..impls.placement import Placement
from .reshard import ExpertTensors, check_shared_params, layer_name, stored_for_rank, whole_experts
from .state_dicts import EXPERTS, PLACEMENT_KEY, find_moe_layers, new_state, record_placement

RESHARD_HINT = ("a checkpoint saved by another number of processes loads with "
                "tutel.checkpoint.load_resharded(model, pattern, saved_world_size)")


def layer_rank(layer) -> int:
    """The layer's rank in its expert-parallel group."""
    from ..impls.communicate import get_world_rank
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


def moe_layers(model: torch.nn.Module) -> Dict[str, torch.nn.Module]:
    """{state-dict prefix: layer} for every moe_layer inside `model` (the model itself included)."""
    from ..impls.moe_layer import MOELayer
    return {(name + "." if name else ""): module for name, module in model.named_modules()
            if isinstance(module, MOELayer)}


def load_resharded(model: torch.nn.Module, pattern: str, saved_world_size: int, namespace: Optional[str] = None,
                   strict: bool = True, trust_pickle: bool = False):
    """Loads per-rank checkpoint files saved by `saved_world_size` processes into `model`,
    whatever the number of processes running it now.

    Call it on every process (after building the model, which fixes this process's rank
    and world size).  Each process reads rank 0's file (for the parameters outside the
    experts) and the files holding its own experts, checks that each of them is there
    exactly once, joins or cuts them for its placement and loads the result with
    ``model.load_state_dict``.

    Args:
        model: a module containing moe_layer(s), built for the current world size.
        pattern: file name with ``{rank}`` (and optionally ``{size}``), as in Tutel's
            ``--checkpoint_path``; e.g. ``'ckpt/model-{rank}-of-{size}.pt'``.
        saved_world_size: how many processes wrote the files (the N in ``{size}``).
        namespace: where the state dict sits inside each file, 'a/b' for file['a']['b'].
        strict: passed to ``load_state_dict``.
        trust_pickle: allow arbitrary pickled objects in the files (``torch.load`` with
            ``weights_only=False``); leave False unless you trust the files.

    Returns:
        what ``model.load_state_dict`` returns (missing and unexpected keys).
    """
    layers = moe_layers(model)
    files = rank_files(pattern, saved_world_size, "pattern")
    needed = {0}
    for layer in layers.values():
        saved = Placement(layer.num_global_experts, saved_world_size)
        for expert, _ in Placement(layer.num_global_experts, layer.world_size).pieces(layer_rank(layer)):
            needed.update(saved.owners(expert))
    states, _ = read_states(files, namespace, trust_pickle, wanted=needed)
    absent = [files[i] for i in sorted(needed) if states[i] is None]
    if absent:
        raise FileNotFoundError(f"load_resharded: this process needs {', '.join(absent)}, which do(es) not exist "
                                f"(pattern {pattern!r}, saved_world_size={saved_world_size})")
    counts = find_moe_layers(states[0])
    for prefix, layer in layers.items():
        if prefix in counts and counts[prefix] != layer.num_global_experts:
            raise ValueError(f"load_resharded: MoE layer {layer_name(prefix)} has {layer.num_global_experts} global experts "
                             f"but the checkpoint has {counts[prefix]}")
        if prefix not in counts and strict:
            raise ValueError(f"load_resharded: the checkpoint has no MoE layer {layer_name(prefix)} (it has "
                             f"{sorted(counts)})")
    check_shared_params(states, files, counts)
    result = new_state(states[0])
    for key, value in states[0].items():
        result[key] = value
    for prefix, layer in layers.items():
        if prefix not in counts:
            continue
        mine = Placement(layer.num_global_experts, layer.world_size)
        wanted = {expert for expert, _ in mine.pieces(layer_rank(layer))}
        experts = whole_experts(states, files, prefix, layer.num_global_experts, wanted,
                                expert_full_sizes_of(layer.experts))
        for name, param in experts.items():
            key = prefix + EXPERTS + name
            result[key] = stored_for_rank(param, f"`{key}`", mine, layer_rank(layer))
        record_placement(result._metadata.setdefault(prefix[:-1], {}), layer_rank(layer), layer.world_size)
    return model.load_state_dict(result, strict=strict)

