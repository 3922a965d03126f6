"""Keeping a gate's parameters in float32 while the rest of the model changes dtype."""
import torch


class Float32ParametersMixin:
    """For modules with ``fp32_gate=True``: module.half() / .bfloat16() / .to(dtype) move the
    parameters between devices but keep them float32, so routing always runs in float32."""

    fp32_gate: bool = False

    def _apply(self, fn, *args, **kwargs):
        result = super()._apply(fn, *args, **kwargs)
        if self.fp32_gate:
            for param in self.parameters(recurse=True):
                if param.is_floating_point() and param.dtype != torch.float32:
                    param.data = param.data.float()
        return result
