"""Tutel MoE feed-forward blocks for fairseq's Transformer decoder.

``apply_patch.py`` copies this file to ``fairseq/modules/tutel_moe.py`` and adds three calls
to fairseq (see README.md):

* ``install_tutel_moe(self.layers, ...)`` at the end of ``TransformerDecoder.__init__``: the
  feed-forward block of every MOE-th decoder layer becomes a tutel ``moe_layer`` (top-2,
  capacity_factor 0 = dropless, fp32 gate, gate noise 1.0, one expert per process);
* ``add_l_aux(loss, sample["ntokens"])`` in the cross-entropy criterion: adds the layers'
  load-balancing losses, weighted by ``L_AUX_WT`` x tokens (fairseq's loss is summed over
  tokens);
* ``zero_non_finite_grads(...)`` in the fp16 optimizer, when ``NO_OVERFLOW=1``.

Environment: ``MOE`` (every MOE-th layer; 0 or unset = none), ``L_AUX_WT`` (default 0.01),
``NO_OVERFLOW``.
"""
import os
from typing import Callable, Iterable

import torch

from tutel import moe, system


def moe_every() -> int:
    return int(os.environ.get("MOE", "0") or 0)


class TutelMoeFFN(torch.nn.Module):
    """fc1 -> activation -> activation dropout -> fc2 of one decoder layer, as an MoE layer.

    Takes and returns fairseq's [time, batch, embed_dim] activations; stores the layer's
    load-balancing loss in tutel.system.cache() under ``key`` for the criterion."""

    def __init__(self, embed_dim: int, ffn_dim: int, activation: Callable[[torch.Tensor], torch.Tensor],
                 activation_dropout: torch.nn.Module, key: str):
        super().__init__()
        self.key = key
        self.activation_dropout = activation_dropout  # a submodule, so train() / eval() reach it
        self.moe = moe.moe_layer(
            gate_type={"type": "top", "k": 2, "capacity_factor": 0.0, "fp32_gate": True, "gate_noise": 1.0},
            model_dim=embed_dim,
            experts={"type": "ffn", "count_per_node": 1, "hidden_size_per_expert": ffn_dim,
                     "activation_fn": lambda h: self.activation_dropout(activation(h))},
            scan_expert_func=lambda name, param: setattr(param, "expert", True),  # legacy_ddp: not all-reduced
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.moe(x)
        system.cache().set(self.key, y.l_aux)
        return y


def install_tutel_moe(layers: Iterable[torch.nn.Module], every: int = None) -> int:
    """Replaces the feed-forward block of layers every-1, 2*every-1, ... (every = $MOE) by a
    TutelMoeFFN; returns how many were replaced.  The layer keeps calling
    ``fc2(dropout(activation_fn(fc1(x))))``: fc1 becomes the whole MoE block, the others identities."""
    every = moe_every() if every is None else every
    replaced = 0
    for index, layer in enumerate(layers):
        if every <= 0 or (index + 1) % every != 0:
            continue
        layer.fc1 = TutelMoeFFN(layer.fc1.in_features, layer.fc1.out_features, layer.activation_fn,
                                layer.activation_dropout_module, key=f"decoder.{index}")
        layer.activation_fn = _identity
        layer.activation_dropout_module = torch.nn.Identity()
        layer.fc2 = torch.nn.Identity()
        replaced += 1
    return replaced


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def add_l_aux(loss: torch.Tensor, tokens) -> torch.Tensor:
    """loss + L_AUX_WT * tokens * (sum of the MoE layers' l_aux of this forward pass)."""
    values = [value for value in system.cache().get() if isinstance(value, torch.Tensor)]
    if not values:
        return loss
    weight = float(os.environ.get("L_AUX_WT", "0.01"))
    return loss + weight * float(tokens) * torch.stack([v.float() for v in values]).sum().to(loss.dtype)


def zero_non_finite_grads(params) -> None:
    """With NO_OVERFLOW=1: sets inf / NaN gradient entries to 0 instead of skipping the step."""
    if os.environ.get("NO_OVERFLOW", "0") in ("", "0"):
        return
    if isinstance(params, torch.Tensor):
        params = [params]
    elif isinstance(params, dict):
        params = list(params.values())
    for param in params:
        if param.grad is not None:
            param.grad.masked_fill_(~torch.isfinite(param.grad), 0.0)
