"""cumsum_sub_one as PyTorch operations."""
import torch

_INTEGER_MASKS = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
_FLOAT_MASKS = (torch.float32, torch.float64)


def cumsum_sub_one(mask: torch.Tensor) -> torch.Tensor:
    """``torch.cumsum(mask, 0) - 1`` for a 2-D mask: int64 for bool and integer
    masks, the mask's dtype for float32 / float64 ones.

    The -1 is the running sum's starting value, as in the compiled operator, so
    a float column is summed as ``((-1 + m0) + m1) + ...``.
    """
    op = "tutel::cumsum_sub_one"
    if mask.dim() != 2:
        raise ValueError(f"{op}: `mask` must be 2-D, got shape {tuple(mask.shape)}")
    if mask.dtype not in _INTEGER_MASKS + _FLOAT_MASKS:
        raise TypeError(f"{op}: `mask` must be bool, an integer type, float32 or float64, got {mask.dtype}")
    out_dtype = mask.dtype if mask.dtype in _FLOAT_MASKS else torch.int64
    running = mask.to(out_dtype, copy=True)
    if running.shape[0] == 0:
        return running
    running[0] -= 1
    return torch.cumsum(running, 0)
