"""Loading an MoE layer's state_dict: Tutel checkpoints, legacy files, reshaped tensors and
gathered checkpoints (all experts in one file) on any number of processes."""
import logging

import torch

from ..checkpoint.layer_state import local_expert_state, register_placement_record

logger = logging.getLogger("tutel")

__all__ = ["load_moe_state", "register_placement_record"]


def load_moe_state(layer, state_dict, prefix: str, local_metadata=None) -> None:
    """Adjusts `state_dict` in place before the standard loading of `layer`'s entries.

    * A legacy checkpoint without ``_num_global_experts`` loads with a warning.
    * A checkpoint for a different number of global experts fails with a clear error.
    * Missing expert parameters are zero-filled with a warning (Tutel's behaviour).
    * An expert tensor with the layer's number of elements but another shape is viewed to
      the layer's shape (Tutel's re-sharded checkpoints rely on it); a tensor holding all
      global experts (a gathered checkpoint) is cut to this process's experts; any other
      size fails, naming the parameter and the shapes.
    * Experts recorded as saved by another process (another rank, or another world size)
      are refused rather than loaded into the wrong place.
    """
    count_key = prefix + "_num_global_experts"
    if count_key not in state_dict:
        logger.warning("You are loading a legacy format of checkpoint with at least one Tutel MoE layer "
                       "inside (no `%s`); it is assumed to match this layer's %d experts. Saving again "
                       "writes the new format.", count_key, layer.num_global_experts)
        state_dict[count_key] = layer._num_global_experts.clone()
    else:
        stored = int(state_dict[count_key])
        if stored != layer.num_global_experts:
            raise ValueError(f"Failed to load state from checkpoint: the number of global experts mismatch "
                             f"(layer has {layer.num_global_experts}, checkpoint `{count_key}` has {stored})")

    for name, param in layer.experts.named_parameters():
        key = prefix + "experts." + name
        if key not in state_dict:
            logger.warning("Could not find parameter `%s` in state_dict, zero values will be filled into "
                           "this parameter.", key)
            state_dict[key] = torch.zeros_like(param)
    local_expert_state(layer, state_dict, prefix, local_metadata)
