"""Which expert weights a call computes with.

A process holds either whole experts (sharded_count S = 1) or a 1/S slice of one expert's
hidden dim.  The call's adaptive_r decides what is gathered (see
tutel.impls.expert_parallel): r = 0 gathers every expert everywhere; with S > 1 and r >= 1
the S/r processes of a replica group gather their slices (1/r of the hidden dim each).
Gathering uses zero_gather, whose backward reduce-scatters gradients to their owners.
"""
from typing import List, Optional

import torch

from ..collectives.autograd_collectives import zero_gather
from ..collectives.process_groups import create_groups_from_world


def _gather_over(param: Optional[torch.Tensor], group, leading: int) -> Optional[torch.Tensor]:
    """Shards of `param` ([n, ...] per process) from every process of `group`, viewed
    [leading, -1, ...] so that consecutive processes' slices join along dim 1."""
    if param is None:
        return None
    gathered = zero_gather(param, group=group)  # [n * members, ...]
    return gathered.reshape(leading, -1, *param.shape[2:]) if param.dim() > 2 else gathered.reshape(leading, -1)


def _replica_group(ctx, members: int):
    """Groups of `members` consecutive processes of ctx.group (one replica group each)."""
    return create_groups_from_world(group_count=-members, parent_group=ctx.group).model_group


def ffn_weights_for_call(module, ctx):
    """(fc1_w [L', H', M], fc2_w [L', H', O], fc1_b [L', H'] or None, fc2_b [L', O] or None)."""
    fc1_w, fc2_w = module.batched_fc1_w, module.batched_fc2_w
    fc1_b, fc2_b = module.batched_fc1_bias, module.batched_fc2_bias
    world_size = getattr(ctx, "world_size", 1)
    sharded_count = module.sharded_count
    if world_size > 1 and ctx.adaptive_degree == 0:
        experts = ctx.num_global_experts
        fc1_w, fc2_w, fc1_b, fc2_b = (_gather_over(p, ctx.group, experts) for p in (fc1_w, fc2_w, fc1_b, fc2_b))
    elif world_size > 1 and sharded_count > 1:
        members = sharded_count // ctx.adaptive_degree
        if members > 1:
            group = _replica_group(ctx, members)
            fc1_w, fc2_w, fc1_b = (_gather_over(p, group, 1) for p in (fc1_w, fc2_w, fc1_b))
        if fc2_b is not None:
            # the output bias is sliced over all S processes of the expert; each of the r
            # replica groups adds it once, so every one adds 1/r of it
            fc2_b = _gather_over(fc2_b, _replica_group(ctx, sharded_count), 1) / ctx.adaptive_degree
    if fc2_b is not None and fc2_b.size(-1) != module.output_dim:
        fc2_b = fc2_b[..., :module.output_dim]
    return fc1_w, fc2_w, fc1_b, fc2_b


def llama_weights_for_call(module, ctx):
    """(W_fc1, W_fc2, W_fc3) of LlamaFFNNetwork at their full [L, ., .] shapes.

    Each flat shard is gathered over the S processes sharing the experts (and over every
    process when adaptive_r = 0), then cut to the full size."""
    world_size = getattr(ctx, "world_size", 1)
    group = None
    if world_size > 1 and ctx.adaptive_degree == 0:
        group = ctx.group
    elif world_size > 1 and module.sharded_count > 1:
        group = _replica_group(ctx, module.sharded_count)
    weights: List[torch.Tensor] = []
    for name in ("W_fc1", "W_fc2", "W_fc3"):
        flat = getattr(module, name)
        shape = module.full_shapes[name]
        numel = shape[0] * shape[1] * shape[2]
        if group is None:
            # A whole shard is viewed, not narrowed: the backward of a narrow fills a zero tensor
            # of the parameter's size and copies the gradient into it (three weight-sized passes
            # per step, an eighth of a Qwen3-like training step at 2048 tokens).
            weights.append((flat if flat.numel() == numel else flat.narrow(0, 0, numel)).view(shape))
        elif world_size > 1 and ctx.adaptive_degree == 0 and module.sharded_count == 1:
            # every process holds whole experts: stack all processes' experts
            gathered = zero_gather(flat, group=group)
            weights.append(gathered.view(ctx.num_global_experts, *shape[1:]))
        else:
            members = world_size if ctx.adaptive_degree == 0 else module.sharded_count
            experts = members // module.sharded_count
            full = zero_gather(flat, group=group).view(experts, -1)[:, :numel]
            weights.append(full.reshape(experts * shape[0], *shape[1:]))
    return tuple(weights)
