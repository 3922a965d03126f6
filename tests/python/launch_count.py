"""Counting the operators a call dispatches, on fake CUDA tensors (what the CUDA path would launch).

``FakeTensorMode`` with ``device="cuda"`` works on a CPU-only PyTorch: every operator runs its
shape function only, and anything that needs a value on the host (``int(t)``, ``t.tolist()``,
``nonzero``) or a data-dependent shape raises, which is exactly what would break CUDA-graph
capture on a GPU.  ``OperatorCount`` records the operators under that mode, leaving out those
that launch nothing: views, metadata queries and uninitialised allocations.
"""
import contextlib
from typing import Iterator, List

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

# Operators that launch no kernel: allocations without initialisation and metadata queries.
_NO_KERNEL = {
    "aten.empty.memory_format", "aten.empty_strided.default", "aten.new_empty.default",
    "aten.new_empty_strided.default", "aten.empty_like.default", "prim.device.default",
    "aten.lift_fresh.default", "aten.sym_size.int", "aten.sym_stride.int", "aten.sym_numel.default",
    "aten.is_same_size.default", "aten._has_compatible_shallow_copy_type.default",
}


def launches_kernel(func) -> bool:
    """Whether the operator overload `func` would launch work on a device (not a view, alias or
    metadata query, not an uninitialised allocation)."""
    if str(func) in _NO_KERNEL:
        return False
    schema = func._schema
    # A view returns an alias of an input (its return carries an alias annotation, not written).
    if schema.returns and all(ret.alias_info is not None and not ret.alias_info.is_write for ret in schema.returns):
        return False
    return True


class OperatorCount(TorchDispatchMode):
    """Records every operator dispatched inside the mode that launches a kernel."""

    def __init__(self):
        super().__init__()
        self.operators: List[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if launches_kernel(func):
            self.operators.append(str(func))
        return func(*args, **(kwargs or {}))

    def __len__(self) -> int:
        return len(self.operators)


@contextlib.contextmanager
def fake_cuda() -> Iterator[FakeTensorMode]:
    """A FakeTensorMode in which tensors made on "cuda" are fake CUDA tensors, with no shape
    environment: data-dependent shapes and host reads raise."""
    with FakeTensorMode(allow_non_fake_inputs=False) as mode:
        yield mode


def fake_parameters(module: torch.nn.Module, mode: FakeTensorMode, device: str = "cuda",
                    dtype: torch.dtype = None) -> torch.nn.Module:
    """`module` with every parameter and buffer replaced by a fake tensor on `device` (in `dtype`
    for floating ones), made from the real ones' shapes."""
    def fake(t: torch.Tensor) -> torch.Tensor:
        target = dtype if dtype is not None and t.is_floating_point() else t.dtype
        return mode.from_tensor(t).to(device=device, dtype=target)

    for submodule in module.modules():
        for name, param in list(submodule._parameters.items()):
            if param is not None:
                submodule._parameters[name] = torch.nn.Parameter(fake(param.detach()), param.requires_grad)
        for name, buffer in list(submodule._buffers.items()):
            if buffer is not None:
                submodule._buffers[name] = fake(buffer)
    return module
