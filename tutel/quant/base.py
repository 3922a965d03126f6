"""What every quantized expert stack offers, whatever its format.

A stack holds E experts' matrices W[e] of shape (N, K) (out_features x in_features, the layout of
``nn.Linear.weight``) as packed codes plus scales, never as a dequantized copy.  Its tensors all
have the experts as their first dimension, so taking some experts (an expert-parallel shard) is
one slice or ``index_select`` of each; ``tensors()`` and ``metadata()`` are what a state dict
stores and what the constructor takes back: ``type(w)(**w.tensors(), **w.metadata())``.
"""
import abc
import enum
from typing import Any, Dict, Optional, Sequence, Tuple, TypeVar, Union

import torch

from .checks import shape_text

ExpertIds = Union[slice, Sequence[int], torch.Tensor]
Stack = TypeVar("Stack", bound="QuantizedWeights")


class GateUpRows(str, enum.Enum):
    """How a fused gate/up matrix (N = 2 x intermediate rows) orders its rows.

    CONCATENATED: rows [0, N/2) are the gate, [N/2, N) the up projection (transformers' fused
    ``gate_up_proj``, FP8Experts).  INTERLEAVED: even rows are the gate, odd rows the up projection
    (gpt-oss)."""
    CONCATENATED = "concatenated"
    INTERLEAVED = "interleaved"


def gate_up_rows_of(value: Union[GateUpRows, str, None], out_features: int) -> Optional[GateUpRows]:
    """The GateUpRows `value` names (None: the matrix is no fused gate/up matrix); a ValueError for
    another name, or a fused matrix with an odd row count."""
    if value is None:
        return None
    try:
        rows = GateUpRows(value)
    except ValueError:
        allowed = ", ".join(repr(member.value) for member in GateUpRows)
        raise ValueError(f"gate_up_rows={value!r} is not allowed; expected {allowed} or None") from None
    if out_features % 2:
        raise ValueError(f"gate_up_rows={rows.value!r} needs an even out_features (gate and up rows in pairs), "
                         f"got {out_features}")
    return rows


class QuantizedWeights(abc.ABC):
    """A stack of E quantized (N, K) expert matrices: packed codes, scales and format metadata.

    Subclasses validate their checkpoint tensors once, in the constructor; slicing by experts and
    moving between devices reuse the validated tensors without checking them again."""

    format: str = ""

    def __init__(self, tensors: Dict[str, torch.Tensor], out_features: int, in_features: int,
                 gate_up_rows: Union[GateUpRows, str, None]) -> None:
        self._tensors = dict(tensors)
        self._features = (int(out_features), int(in_features))
        self._gate_up_rows = gate_up_rows_of(gate_up_rows, int(out_features))

    # -- shape and metadata ---------------------------------------------------------------------

    @property
    def experts(self) -> int:
        """E: the number of expert matrices in the stack."""
        return int(next(iter(self._tensors.values())).shape[0])

    @property
    def out_features(self) -> int:
        """N: the rows of each expert's matrix."""
        return self._features[0]

    @property
    def in_features(self) -> int:
        """K: the columns of each expert's matrix (unpacked elements)."""
        return self._features[1]

    @property
    def shape(self) -> Tuple[int, int, int]:
        """(E, N, K): the shape of the dequantized stack."""
        return (self.experts, self.out_features, self.in_features)

    @property
    def device(self) -> torch.device:
        """The device every tensor of the stack lies on."""
        return next(iter(self._tensors.values())).device

    @property
    def gate_up_rows(self) -> Optional[GateUpRows]:
        """How a fused gate/up matrix orders its rows, or None for any other matrix."""
        return self._gate_up_rows

    def gate_and_up_rows(self) -> Tuple[slice, slice]:
        """The row slices of the gate and of the up projection in a fused gate/up matrix."""
        rows = self.out_features
        if self._gate_up_rows is GateUpRows.CONCATENATED:
            return slice(0, rows // 2), slice(rows // 2, rows)
        if self._gate_up_rows is GateUpRows.INTERLEAVED:
            return slice(0, rows, 2), slice(1, rows, 2)
        raise ValueError(f"this {type(self).__name__} is no fused gate/up matrix (gate_up_rows=None)")

    def tensors(self) -> Dict[str, torch.Tensor]:
        """The stack's tensors by constructor argument name (experts first in each), for a state dict."""
        return dict(self._tensors)

    def metadata(self) -> Dict[str, Any]:
        """The constructor's other keyword arguments, as plain Python values."""
        return {"gate_up_rows": None if self._gate_up_rows is None else self._gate_up_rows.value}

    def packed_bytes(self) -> int:
        """Bytes of the packed weights and all their scales (what a decode step reads per token at most)."""
        return sum(tensor.numel() * tensor.element_size() for tensor in self._tensors.values())

    # -- the format -----------------------------------------------------------------------------

    @abc.abstractmethod
    def dequantize_reference(self, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """The whole (E, N, K) stack dequantized as the format's specification defines it, computed
        in float64 (exact) and rounded once to `dtype`.  A reference for tests: it allocates the
        full-precision stack."""

    # -- experts and devices --------------------------------------------------------------------

    def _rebuild(self: Stack, tensors: Dict[str, torch.Tensor]) -> Stack:
        """A stack of the same format and metadata over `tensors` (already valid: not checked again)."""
        stack = object.__new__(type(self))
        stack.__dict__.update(self.__dict__)
        stack._tensors = tensors
        return stack

    def select_experts(self: Stack, ids: ExpertIds) -> Stack:
        """The stack of the experts `ids`, in that order: a slice (step > 0) gives views, a sequence of
        ints or a 1-D integer tensor copies them (an expert-parallel shard, say).  Ids must lie in
        [0, experts); checking a CUDA tensor of ids reads it on the host."""
        if isinstance(ids, slice):
            if ids.step is not None and ids.step <= 0:
                raise ValueError(f"ids: slice {ids} has step {ids.step}; expected a step > 0")
            return self._rebuild({name: tensor[ids] for name, tensor in self._tensors.items()})
        index = self._expert_index(ids)
        return self._rebuild({name: tensor.index_select(0, index) for name, tensor in self._tensors.items()})

    def _expert_index(self, ids: Union[Sequence[int], torch.Tensor]) -> torch.Tensor:
        if isinstance(ids, torch.Tensor):
            if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool or ids.dim() != 1:
                raise ValueError(f"ids: dtype {ids.dtype}, shape {shape_text(ids.shape)}; expected a 1-D integer "
                                 f"tensor of expert ids")
            index = ids.to(device=self.device, dtype=torch.int64)
        else:
            values = list(ids)
            if any(isinstance(value, bool) or not isinstance(value, int) for value in values):
                raise TypeError(f"ids: expected a slice, a sequence of ints or a 1-D integer tensor, got {ids!r}")
            index = torch.tensor(values, dtype=torch.int64, device=self.device)
        if index.numel():
            low, high = int(index.min()), int(index.max())
            if low < 0 or high >= self.experts:
                bad = low if low < 0 else high
                raise ValueError(f"ids: expert id {bad} is out of range; expected ids in [0, {self.experts})")
        return index

    def expert(self: Stack, index: int) -> Stack:
        """Expert `index` alone, as a stack of one (views of this stack's tensors)."""
        if isinstance(index, bool) or not isinstance(index, int):
            raise TypeError(f"index: expected an int, got {type(index).__name__}")
        if not 0 <= index < self.experts:
            raise ValueError(f"index={index} is out of range; expected an expert id in [0, {self.experts})")
        return self.select_experts(slice(index, index + 1))

    def with_tensors(self: Stack, tensors: Dict[str, torch.Tensor]) -> Stack:
        """This stack's format and metadata over `tensors`: the names of its own tensors, each of its
        own tensor's shape and dtype, all on one device (any).  For the same checkpoint tensors read
        again (a model's parameters at each call, with this stack kept on the meta device as their
        checked template): their values were checked when this stack was built and are not read
        here.  A ValueError names the first tensor that differs."""
        if not isinstance(tensors, dict) or tensors.keys() != self._tensors.keys():
            given = sorted(tensors) if isinstance(tensors, dict) else type(tensors).__name__
            raise ValueError(f"tensors: expected a dict of {sorted(self._tensors)}, got {given}")
        device = None
        for name, tensor in tensors.items():
            own = self._tensors[name]
            if not isinstance(tensor, torch.Tensor) or tensor.shape != own.shape or tensor.dtype != own.dtype:
                what = f"shape {shape_text(tensor.shape)}, dtype {tensor.dtype}" if isinstance(tensor, torch.Tensor) \
                    else type(tensor).__name__
                raise ValueError(f"tensors[{name!r}]: {what}; expected shape {shape_text(own.shape)}, dtype "
                                 f"{own.dtype} (this {type(self).__name__}'s own)")
            if device is None:
                device = tensor.device
            elif tensor.device != device:
                raise ValueError(f"tensors[{name!r}]: on {tensor.device}, the others on {device}; expected all "
                                 f"tensors of one expert stack on one device")
        return self._rebuild(dict(tensors))

    def to(self: Stack, device: Union[torch.device, str], non_blocking: bool = False) -> Stack:
        """The stack with every tensor on `device` (codes and scales keep their dtypes)."""
        device = torch.device(device)
        return self._rebuild({name: tensor.to(device, non_blocking=non_blocking)
                              for name, tensor in self._tensors.items()})

    def __repr__(self) -> str:
        rows = None if self._gate_up_rows is None else self._gate_up_rows.value
        extra = "".join(f", {key}={value!r}" for key, value in self.metadata().items() if key != "gate_up_rows")
        return (f"{type(self).__name__}(experts={self.experts}, out_features={self.out_features}, "
                f"in_features={self.in_features}{extra}, gate_up_rows={rows!r}, device={self.device})")

