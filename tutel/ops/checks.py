"""Argument validation shared by the operators, the routing API, the MoE layer and the
collectives: each raises a clear exception naming the function, the argument and what is allowed."""
import math
from typing import Sequence, Union

import torch

FLOATING_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype in which data of `dtype` is weighted and summed: float64 stays float64, all else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def require_tensor(value, name: str, where: str, min_dim: int = 0) -> torch.Tensor:
    """Returns `value` if it is a tensor with at least `min_dim` dims; raises naming `name` otherwise."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{where}: `{name}` must be a torch.Tensor, got {type(value).__name__}")
    if value.dim() < min_dim:
        raise ValueError(f"{where}: `{name}` must have at least {min_dim} dimension(s), got shape {tuple(value.shape)}")
    return value


def require_floating(value, name: str, where: str) -> torch.Tensor:
    require_tensor(value, name, where)
    if value.dtype not in FLOATING_DTYPES:
        raise TypeError(
            f"{where}: `{name}` must be float32, float64, bfloat16 or float16, got {value.dtype}"
        )
    return value


def require_dim(value: torch.Tensor, dim: int, name: str, where: str) -> torch.Tensor:
    if value.dim() != dim:
        raise ValueError(f"{where}: `{name}` must be {dim}-D, got shape {tuple(value.shape)}")
    return value


def require_int(value, name: str, where: str, minimum: int = 0) -> int:
    """An integer argument (Python int, SymInt or 0-d integer tensor) that is >= minimum."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.dtype.is_floating_point or value.dtype == torch.bool:
            raise TypeError(f"{where}: `{name}` must be an integer, got a tensor of shape "
                            f"{tuple(value.shape)} and dtype {value.dtype}")
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, (int, torch.SymInt)):
        raise TypeError(f"{where}: `{name}` must be an integer, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{where}: `{name}` must be >= {minimum}, got {value}")
    return value


def require_top_k(value, num_experts: int, where: str) -> int:
    """A per-call top_k: an integer with 1 <= top_k <= num_experts."""
    top_k = require_int(value, "top_k", where, minimum=1)
    if top_k > num_experts:
        raise ValueError(f"{where}: top_k={top_k} exceeds num_global_experts={num_experts}; "
                         f"allowed: 1 <= top_k <= {num_experts}")
    return top_k


def require_finite_number(value, name: str, where: str) -> float:
    if isinstance(value, torch.Tensor):
        value = float(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{where}: `{name}` must be a number, got {type(value).__name__}")
    if not math.isfinite(value):
        raise ValueError(f"{where}: `{name}` must be a finite number, got {value}")
    return value


TensorOrList = Union[torch.Tensor, Sequence[torch.Tensor]]


def stack_choices(value: TensorOrList, name: str, where: str) -> torch.Tensor:
    """[k, T] tensor from either a [k, T] tensor or a list of k tensors of T entries each."""
    if isinstance(value, torch.Tensor):
        return require_dim(value, 2, name, where)
    if not isinstance(value, (list, tuple)) or len(value) == 0:
        raise TypeError(f"{where}: `{name}` must be a [k, tokens] tensor or a non-empty list of "
                        f"k tensors, got {type(value).__name__}")
    for j, item in enumerate(value):
        require_tensor(item, f"{name}[{j}]", where)
    rows = [item.reshape(-1) for item in value]
    if any(row.numel() != rows[0].numel() for row in rows):
        raise ValueError(f"{where}: every tensor in `{name}` must have the same number of tokens, "
                         f"got {[row.numel() for row in rows]}")
    if len(rows) == 1:
        return rows[0].unsqueeze(0)
    return torch.stack(rows)


def as_slot_tensor(value: TensorOrList, name: str, where: str) -> torch.Tensor:
    """indices / locations as a contiguous int32 [k, T] tensor."""
    stacked = stack_choices(value, name, where)
    if stacked.dtype.is_floating_point or stacked.dtype.is_complex or stacked.dtype == torch.bool:
        raise TypeError(f"{where}: `{name}` must hold integers, got dtype {stacked.dtype}")
    return stacked.to(torch.int32).contiguous()


def same_device(reference: torch.Tensor, value: torch.Tensor, name: str, where: str) -> None:
    if value.device != reference.device:
        raise ValueError(f"{where}: `{name}` is on {value.device} but the data is on {reference.device}")
