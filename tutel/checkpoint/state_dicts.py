"""Finding the MoE layers of a state dict, and the placement record every layer leaves in it.

A layer's keys are ``<prefix>_num_global_experts`` and ``<prefix>experts.<name>`` (Tutel's
format).  ``moe_layer.state_dict()`` also records, in the state dict's ``_metadata`` (the
per-module dict that torch saves and hands back to ``_load_from_state_dict``), which process
of how many wrote the experts: ``{'tutel_expert_placement': {'rank': r, 'world_size': W}}``.
Files without it (Tutel's, or dicts rebuilt by hand) are placed by their position.
"""
import collections
from typing import Dict, List, Mapping, MutableMapping, Optional, Tuple

import torch

COUNT_SUFFIX = "_num_global_experts"
EXPERTS = "experts."
PLACEMENT_KEY = "tutel_expert_placement"


def find_moe_layers(state: Mapping[str, torch.Tensor],
                    default_num_global_experts: Optional[int] = None) -> Dict[str, int]:
    """{layer prefix: number of global experts} of every MoE layer in `state`.

    Layers are found by their ``_num_global_experts`` entry.  A legacy checkpoint has none:
    then every key with an ``experts`` component counts as an expert parameter of the layer
    named by what precedes it, with ``default_num_global_experts`` experts."""
    layers = {}
    for key, value in state.items():
        if key.endswith(COUNT_SUFFIX) and (key == COUNT_SUFFIX or key[-len(COUNT_SUFFIX) - 1] == "."):
            layers[key[:-len(COUNT_SUFFIX)]] = int(value)
    if layers:
        return layers
    if default_num_global_experts is None:
        raise ValueError("no MoE layer found: no key ends in `_num_global_experts`. For a legacy checkpoint "
                         "written before that key existed, give the expert count (--default_num_global_experts=K)")
    if int(default_num_global_experts) < 1:
        raise ValueError(f"default_num_global_experts must be >= 1, got {default_num_global_experts}")
    for key in state:
        parts = key.split(".")
        if "experts" in parts[:-1]:
            prefix = ".".join(parts[:parts.index("experts")])
            layers[prefix + "." if prefix else ""] = int(default_num_global_experts)
    if not layers:
        raise ValueError("no MoE layer found: no `_num_global_experts` key and no key with an `experts` component")
    return layers


def expert_names(state: Mapping[str, torch.Tensor], prefix: str) -> List[str]:
    """Names (after ``<prefix>experts.``) of the layer's expert parameters, in the state's order."""
    start = prefix + EXPERTS
    return [key[len(start):] for key in state if key.startswith(start)]


def is_expert_key(key: str, layers: Mapping[str, int]) -> bool:
    return any(key.startswith(prefix + EXPERTS) for prefix in layers)


def recorded_placement(state: Mapping, prefix: str) -> Optional[Tuple[int, int]]:
    """(rank, world_size) recorded for the layer at `prefix`, or None."""
    metadata = getattr(state, "_metadata", None) or {}
    record = (metadata.get(prefix[:-1]) or {}).get(PLACEMENT_KEY)
    if not record:
        return None
    return int(record["rank"]), int(record["world_size"])


def record_placement(local_metadata: MutableMapping, rank: int, world_size: int) -> None:
    """Writes the placement record into a module's local metadata dict."""
    local_metadata[PLACEMENT_KEY] = {"rank": int(rank), "world_size": int(world_size)}


def new_state(template: Mapping) -> "collections.OrderedDict":
    """An empty state dict carrying a copy of `template`'s metadata (if any)."""
    state = collections.OrderedDict()
    state._metadata = collections.OrderedDict(
        (key, dict(value)) for key, value in (getattr(template, "_metadata", None) or {}).items())
    return state


def set_placement(state, layers, rank: int, world_size: int) -> None:
    """Records (rank, world_size) for every layer of `state` (made by new_state)."""
    for prefix in layers:
        record_placement(state._metadata.setdefault(prefix[:-1], {}), rank, world_size)
