"""Cumulative sum minus one: each token's slot for a one-hot routing mask."""
import torch

from .checks import require_int, require_tensor
from .backend import operators_for


def cumsum_sub_one(data: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """Returns ``torch.cumsum(data, dim) - 1`` computed in one pass.

    Integer and bool inputs produce int64 (as torch.cumsum does); float32 and
    float64 keep their dtype.  Any rank >= 1 and any dim are accepted.
    """
    where = "tutel.fast_cumsum_sub_one"
    require_tensor(data, "data", where)
    if data.dim() == 0:
        raise ValueError(f"{where}: `data` must have at least one dimension")
    dim = require_int(dim, "dim", where, minimum=-data.dim())
    if dim >= data.dim():
        raise ValueError(f"{where}: dim={dim} is out of range for a {data.dim()}-D tensor")
    moved = data.movedim(dim, 0)
    shape = moved.shape
    columns = 1
    for size in shape[1:]:
        columns *= size
    flat = moved.reshape(shape[0], columns)
    return operators_for(flat.device).cumsum_sub_one(flat).reshape(shape).movedim(0, dim)
