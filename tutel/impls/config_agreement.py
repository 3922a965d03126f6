"""Checking, once at construction, that every process built the same MoE layer.

A layer built differently on one process (another model_dim, expert count, k, hidden
size...) would make the first all-to-all fail with an opaque size error or a crash.  One
all-gather of a few integers per layer, when it is built, names the processes and the
setting that differ instead.
"""
import zlib
from typing import Dict, List

import torch

from ..collectives.process_groups import group_ranks
from ..collectives.simple_collectives import simple_all_gather


def layer_fingerprint(layer) -> Dict[str, int]:
    """The settings every process of the layer's group must share, as integers."""
    fingerprint = {
        "model_dim": layer.model_dim,
        "num_global_experts": layer.num_global_experts,
        "sharded_count": layer.sharded_count,
        "number of gates": len(layer.gates),
        "is_postscore": int(layer.is_postscore),
        "batch_prioritized_routing": int(layer.batch_prioritized_routing),
        "normalize_gate": int(layer.normalize_gate),
        "use_2dh": int(layer.use_2dh),
        "expert parameter count": sum(p.numel() for p in layer.experts.parameters()),
    }
    for index, gate in enumerate(layer.gates):
        fingerprint[f"gates[{index}].top_k"] = int(gate.top_k)
        # the scored-routing options as one number (crc32 of their repr: the same on every process)
        fingerprint[f"gates[{index}] scored-routing options"] = zlib.crc32(
            repr(getattr(gate, "routing_options", None)).encode())
    shared = getattr(layer, "shared_experts", None)
    fingerprint["shared expert parameter count"] = 0 if shared is None else sum(p.numel() for p in shared.parameters())
    return fingerprint


def check_same_configuration(layer) -> None:
    """Raises ValueError on every process if the processes of layer.group built different layers."""
    fingerprint = layer_fingerprint(layer)
    names: List[str] = list(fingerprint)
    mine = torch.tensor([len(names)] + [fingerprint[name] for name in names], dtype=torch.int64)
    device = next((p.device for p in layer.parameters()), torch.device("cpu"))
    table = simple_all_gather(mine.to(device).unsqueeze(0), group=layer.group).cpu()
    ranks = group_ranks(layer.group)
    differing = []
    for row, rank in zip(table.tolist(), ranks):
        if row == table[0].tolist():
            continue
        if row[0] != len(names):
            differing.append(f"process {rank} has a different number of gates")
            continue
        for name, value, reference in zip(names, row[1:], table[0].tolist()[1:]):
            if value != reference:
                differing.append(f"process {rank} has {name} = {value} where process {ranks[0]} has {reference}")
    if differing:
        raise ValueError("moe_layer: the processes of the expert group built different layers: "
                         + "; ".join(differing))
