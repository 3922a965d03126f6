"""The argument checks of the quantized formats: each raises one TypeError or ValueError that names
the tensor, what it holds (shape, dtype, device) and what is allowed."""
from typing import Optional, Sequence, Tuple

import torch


def shape_text(shape: Sequence[int]) -> str:
    """(4, 8, 16): a shape as the messages write it."""
    return str(tuple(int(size) for size in shape))


def require_tensor(name: str, value: object) -> torch.Tensor:
    """`value` itself, or a TypeError when it is no tensor."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(value).__name__}")
    return value


def require_dtype(name: str, tensor: torch.Tensor, allowed: Sequence[torch.dtype], note: str = "") -> None:
    """A ValueError unless `tensor`'s dtype is one of `allowed`."""
    if tensor.dtype not in allowed:
        names = " or ".join(str(dtype) for dtype in allowed)
        raise ValueError(f"{name}: dtype {tensor.dtype} (shape {shape_text(tensor.shape)}) is not allowed; "
                         f"expected {names}{note}")


def require_ndim(name: str, tensor: torch.Tensor, ndim: int, layout: str) -> None:
    """A ValueError unless `tensor` has `ndim` dimensions (`layout` names them)."""
    if tensor.dim() != ndim:
        raise ValueError(f"{name}: shape {shape_text(tensor.shape)} has {tensor.dim()} dimensions; "
                         f"expected {ndim}: {layout}")


def require_shape(name: str, tensor: torch.Tensor, expected: Tuple[int, ...], reference: str,
                  reference_shape: Sequence[int], rule: str = "") -> None:
    """A ValueError unless `tensor`'s shape is `expected`, the shape that tensor `reference` (of
    `reference_shape`) implies by `rule`.  A differing first size is reported as an expert-count
    mismatch."""
    if tuple(tensor.shape) == tuple(expected):
        return
    if tensor.dim() == len(expected) and len(expected) and tensor.shape[0] != expected[0]:
        raise ValueError(f"{name}: shape {shape_text(tensor.shape)} holds {tensor.shape[0]} experts but {reference} "
                         f"(shape {shape_text(reference_shape)}) holds {expected[0]}; expected {shape_text(expected)}")
    raise ValueError(f"{name}: shape {shape_text(tensor.shape)} does not match {reference} (shape "
                     f"{shape_text(reference_shape)}){rule}; expected {shape_text(expected)}")


def require_same_device(first: Tuple[str, torch.Tensor], *others: Tuple[str, torch.Tensor]) -> None:
    """A ValueError unless every tensor lies on the first one's device."""
    name, tensor = first
    for other_name, other in others:
        if other.device != tensor.device:
            raise ValueError(f"{other_name}: on {other.device} but {name} on {tensor.device}; "
                             f"expected all tensors of one expert stack on one device")


def first_index(mask: torch.Tensor) -> Optional[Tuple[int, ...]]:
    """The first index where the bool tensor `mask` is true (row-major order), or None."""
    found = mask.nonzero()
    return None if found.shape[0] == 0 else tuple(int(i) for i in found[0].tolist())


def require_none_where(name: str, tensor: torch.Tensor, mask: torch.Tensor, what: str, allowed: str) -> None:
    """A ValueError naming the first entry of `tensor` where `mask` holds (`what` it is there)."""
    index = first_index(mask)
    if index is not None:
        raise ValueError(f"{name}: {what} at index {index} (shape {shape_text(tensor.shape)}, dtype {tensor.dtype}); "
                         f"{allowed}")


def require_positive_int(name: str, value: object) -> int:
    """`value` as an int, or a TypeError/ValueError unless it is an integer > 0."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected an integer, got {type(value).__name__} {value!r}")
    if value <= 0:
        raise ValueError(f"{name}={value} is not allowed; expected an integer > 0")
    return value


FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def require_float_stack(name: str, weight: object) -> torch.Tensor:
    """`weight` when it is a floating (E, N, K) tensor a quantizer takes, else a TypeError/ValueError."""
    weight = require_tensor(name, weight)
    require_dtype(name, weight, FLOAT_DTYPES)
    require_ndim(name, weight, 3, "(experts, out_features, in_features)")
    return weight


def require_finite(name: str, matrix: torch.Tensor, expert: int) -> None:
    """A ValueError naming the first NaN or infinity of expert `expert`'s matrix of stack `name`."""
    index = first_index(~torch.isfinite(matrix))
    if index is not None:
        raise ValueError(f"{name}: {matrix[index].item()} at index {(expert,) + index} (dtype {matrix.dtype}); "
                         f"a quantizer takes finite values only")


def require_multiple(name: str, tensor: torch.Tensor, what: str, value: int, multiple: int, why: str) -> None:
    """A ValueError unless `value` (`what` of `tensor`) is a multiple of `multiple` (`why`)."""
    if value % multiple:
        raise ValueError(f"{name}: shape {shape_text(tensor.shape)} gives {what} = {value}, which is no multiple of "
                         f"{multiple} ({why})")
