"""Whether torch.compile is tracing the current call (on every supported PyTorch), and whether a call
may skip the custom-operator and autograd wrappers."""
from typing import Optional
import torch


# Looked up once: the no-grad CPU paths ask on every call, where the lookups cost a few
# microseconds with the caches cold.
_COMPILER_IS_COMPILING = getattr(getattr(torch, "compiler", None), "is_compiling", None)


def is_compiling() -> bool:
    """True while torch.compile (Dynamo) traces; False on PyTorch versions without it."""
    return _COMPILER_IS_COMPILING is not None and bool(_COMPILER_IS_COMPILING())


def eager_without_grad(*tensors: Optional[torch.Tensor]) -> bool:
    """True when nothing is traced and no gradient flows to any of `tensors` (None entries
    allowed): the operators may then be called directly, without the custom-op dispatch and
    autograd wrappers, whose cost matches a decoding step's arithmetic on small experts."""
    if _COMPILER_IS_COMPILING is not None and _COMPILER_IS_COMPILING():  # (is_compiling, inline)
        return False
    if torch.is_grad_enabled():
        for t in tensors:  # (a loop, not any(...): a generator costs a call per tensor)
            if t is not None and t.requires_grad:
                return False
    return True


_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)
# (private, but one C call; without it every call takes the dispatcher)
_DISPATCH_MODES = getattr(torch._C, "_len_torch_dispatch_stack", None)


def direct_call_allowed(*tensors: Optional[torch.Tensor]) -> bool:
    """True when a C++ implementation bound in tutel._C may run in place of its registered operator:
    no Python dispatch mode is active (it would not see the call) and every tensor of `tensors`
    (None entries allowed) is of a plain class (a subclass such as DTensor dispatches itself)."""
    if _DISPATCH_MODES is None or _DISPATCH_MODES() > 0:
        return False
    for t in tensors:  # (a loop, not all(...): a generator costs a call per tensor)
        if t is not None and type(t) not in _PLAIN_TENSORS:
            return False
    return True


def is_fake(t: torch.Tensor) -> bool:
    """True for a FakeTensor (shapes only, no storage: its address and values cannot be read)."""
    return _FAKE_TENSOR is not None and isinstance(t, _FAKE_TENSOR)


try:  # looked up once; PyTorch versions without fake tensors have none to recognise
    from torch._subclasses.fake_tensor import FakeTensor as _FAKE_TENSOR
except ImportError:  # pragma: no cover
    _FAKE_TENSOR = None
