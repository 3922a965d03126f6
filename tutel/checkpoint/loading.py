"""Loading checkpoints into MoE layers whose world size differs from the one that saved them.

* ``moe_layer.load_state_dict`` accepts a gathered (global-form) checkpoint: each process
  keeps its own experts (``layer_state.local_expert_state``, called from the layer).
* ``load_resharded(model, pattern, saved_world_size)`` loads the per-rank files of N
  processes into a model running on M processes, reading only the files that hold this
  process's experts.
"""
from typing import Dict, Optional

import torch

from .files import rank_files, read_states
from ..rules.placement import Placement
from .layer_state import expert_full_sizes_of, layer_rank
from .reshard import check_shared_params, layer_name, stored_for_rank, whole_experts
from .state_dicts import COUNT_SUFFIX, EXPERTS, find_moe_layers, new_state, record_placement


def moe_layers(model: torch.nn.Module) -> Dict[str, torch.nn.Module]:
    """{state-dict prefix: layer} for every moe_layer inside `model` (the model itself included).

    A layer is recognised the way checkpoints recognise it: by its own ``_num_global_experts``
    buffer (so this module needs no import of the layer class)."""
    return {(name + "." if name else ""): module for name, module in model.named_modules()
            if COUNT_SUFFIX in module._buffers}


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

