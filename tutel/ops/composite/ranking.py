"""Integer keys that sort floating-point values by tutel's ranking rule."""
import torch

from ..checks import accumulation_dtype


def descending_keys(values: torch.Tensor) -> torch.Tensor:
    """Integer keys whose ascending order is the descending order of `values`.

    The values are read in their accumulation dtype (as the compiled operators
    read them); NaN gets the smallest key (it ranks above every number), -0 and
    +0 get the same key.  Sorting the keys with a stable sort therefore gives
    "highest first, NaN first, equal values in index order" without depending on
    how a sort treats floating-point values.  float64 gives int64 keys, the other
    dtypes int32.
    """
    wide = values.to(accumulation_dtype(values.dtype)) + 0.0  # -0 + 0 is +0
    key_dtype = torch.int64 if wide.dtype == torch.float64 else torch.int32
    bits = wide.view(key_dtype)
    magnitude_bits = torch.iinfo(key_dtype).max
    # Negative floats: flipping every bit but the sign makes larger magnitudes smaller.
    ascending = torch.where(bits < 0, bits ^ magnitude_bits, bits)
    smallest = torch.full_like(ascending, torch.iinfo(key_dtype).min)
    return torch.where(torch.isnan(wide), smallest, ~ascending)


def claiming_order(priority: torch.Tensor) -> torch.Tensor:
    """Batch-prioritized order [T] (int64 token numbers): higher priority first,
    NaN first, equal priorities in token order."""
    return torch.sort(descending_keys(priority), stable=True).indices
