"""Which expert weights a call computes with.

A process holds either whole experts (sharded_count S = 1) or a 1/S slice of
one expert.  Depending on the call's adaptive_r, the slices are gathered
(data parallel inside the expert group) or used as they are (model parallel).
In a single process (or S = 1 with r >= 1) the local parameters are used as
they are.
"""
import torch


def _single_process(ctx) -> bool:
    return getattr(ctx, "world_size", 1) == 1


def ffn_weights_for_call(module, ctx):
    """(fc1_w, fc2_w, fc1_b, fc2_b) for FusedExpertsNetwork, fc2 bias cut to output_dim."""
    if not _single_process(ctx):
        raise NotImplementedError("distributed ffn experts are provided by tutel.experts.sharding in a later step")
    fc2_b = module.batched_fc2_bias
    if fc2_b is not None and fc2_b.size(-1) != module.output_dim:
        fc2_b = fc2_b[..., :module.output_dim]
    return module.batched_fc1_w, module.batched_fc2_w, module.batched_fc1_bias, fc2_b


def llama_weights_for_call(module, ctx):
    """(W_fc1, W_fc2, W_fc3) of LlamaFFNNetwork at their full shapes."""
    if not _single_process(ctx):
        raise NotImplementedError("distributed llama_ffn experts are provided by tutel.experts.sharding in a later step")
    weights = []
    for name in ("W_fc1", "W_fc2", "W_fc3"):
        shape = module.full_shapes[name]
        flat = getattr(module, name)
        weights.append(flat.narrow(0, 0, shape[0] * shape[1] * shape[2]).view(shape))
    return tuple(weights)
