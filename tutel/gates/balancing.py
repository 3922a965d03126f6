"""The per-expert selection bias and its auxiliary-loss-free balancing (DeepSeek-V3).

The bias b [E] is added to the routing scores when experts are chosen, never to the weights of
their outputs.  During training the layer counts how many routed choices each expert received;
after the optimizer step the user calls ``tutel.moe.update_selection_biases(model)`` (or
``layer.update_selection_bias()``), which sums the counts over the layer's process group and moves
every bias by

    b_e += rate * sign(mean_e'(load_e') - load_e)

so an overloaded expert becomes less attractive and an idle one more, identically on every
process.  Counts accumulate over the micro-batches between two updates (gradient accumulation
sees the whole step's load).
"""
from typing import Optional

import torch

from ..collectives.simple_collectives import simple_all_reduce

DEFAULT_UPDATE_RATE = 1e-3  # DeepSeek-V3's bias update speed for most of its pre-training


class SelectionBias(torch.nn.Module):
    """The bias of one gate (``bias``, float32 or float64, in the state_dict) and the loads counted
    since the last update (``load``, int64).

    ``load`` is a plain tensor attribute, not a buffer: it is not saved, and DistributedDataParallel
    (which broadcasts rank 0's buffers before every forward) leaves each process's counts alone.
    ``module.half()`` / ``.bfloat16()`` keep the bias float32: steps of 1e-3 would vanish in a
    16-bit bias."""

    def __init__(self, num_experts: int, update_rate: Optional[float] = None):
        super().__init__()
        self.update_rate = DEFAULT_UPDATE_RATE if update_rate is None else float(update_rate)
        self.register_buffer("bias", torch.zeros(num_experts, dtype=torch.float32))
        self.load = torch.zeros(num_experts, dtype=torch.int64)

    def extra_repr(self) -> str:
        return f"num_experts={self.bias.numel()}, update_rate={self.update_rate}"

    def _apply(self, fn, *args, **kwargs):
        before = self.bias
        result = super()._apply(fn, *args, **kwargs)
        if self.bias.dtype in (torch.float16, torch.bfloat16):
            self._buffers["bias"] = before.to(device=self.bias.device, dtype=torch.float32)
        self.load = fn(self.load)  # follows the module's device (integer counts keep their dtype)
        return result

    def record(self, dispatch_count: torch.Tensor) -> None:
        """Adds one call's routed choices per expert ([E], before any capacity drop)."""
        with torch.no_grad():
            self.load.add_(dispatch_count.to(self.load.dtype))

    @torch.no_grad()
    def update(self, group=None) -> torch.Tensor:
        """Moves the bias by rate * sign(mean load - load) from the loads summed over ``group``
        (a collective: every process of the group must call it), clears the counts, and returns
        the global loads that were used."""
        load = simple_all_reduce(self.load.clone(), group=group)
        error = load.double().mean() - load.double()
        self.bias.add_(self.update_rate * torch.sign(error).to(self.bias.dtype))
        self.load.zero_()
        return load


def update_selection_biases(model: torch.nn.Module) -> int:
    """Applies the aux-loss-free bias update to every MoE layer of ``model`` whose gates have a
    selection bias; call it after ``optimizer.step()`` on every process.  Returns how many gate
    biases were updated."""
    updated = 0
    for module in model.modules():
        update = getattr(module, "update_selection_bias", None)
        if callable(update) and hasattr(module, "gates"):
            updated += update()
    return updated
