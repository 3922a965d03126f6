"""Which implementation of tutel's operators runs on each device.

CPU tensors always use the compiled CPU operators, and tensors on devices tutel
has no compiled operators for (mps, xpu, ...) the composite ones.  On a CUDA
device the choice is made once, at the first tutel operator on that device:

* ``TUTEL_CUDA_BACKEND=composite``: the composite PyTorch operators
  (tutel.ops.composite) for everything;
* ``TUTEL_CUDA_BACKEND=nvrtc``: the NVRTC-compiled kernels, unchecked, errors
  raised as they come;
* ``TUTEL_CUDA_BACKEND=auto`` (the default): the kernels if tutel was built with
  CUDA and NVRTC loads, after a self-check that runs them once on small random
  problems and compares them with the composite operators.  An operator whose
  kernel fails or disagrees uses the composite operator on that device from
  then on, with one warning per device naming the kernels and the device.
  ``TUTEL_CUDA_SELF_CHECK=0`` skips the check (the kernels are used as they are).

The self-check is skipped while torch.compile traces, during a CUDA graph
capture and on fake tensors (the kernels are used unchecked then, unless
TUTEL_CUDA_BACKEND says composite, and the choice is made at the next eager
call): fake CUDA tensors take the compiled operators' fake kernels, as the
path of a CUDA build would, even where tutel was built without CUDA.
"""
import contextlib
import os
import threading
import warnings
from types import SimpleNamespace
from typing import Callable, Dict, Iterator, NamedTuple, Optional

import torch

from .extension import load_extension
from . import composite
from .tracing import is_compiling
from .self_check import OPERATORS, compare_operators

# The active mode of a kind (private API, one C call; absent on old PyTorch: no fake mode is seen).
_ACTIVE_MODE = getattr(torch._C, "_get_dispatch_mode", None)
_FAKE_KEY = getattr(getattr(torch._C, "_TorchDispatchModeKey", None), "FAKE", None) if _ACTIVE_MODE else None
BACKEND_VARIABLE = "TUTEL_CUDA_BACKEND"
SELF_CHECK_VARIABLE = "TUTEL_CUDA_SELF_CHECK"
BACKENDS = ("auto", "nvrtc", "composite")
KERNELS, COMPOSITE = "nvrtc", "composite"


def requested_backend() -> str:
    """The value of TUTEL_CUDA_BACKEND (default "auto"); ValueError for another value."""
    value = os.environ.get(BACKEND_VARIABLE, "auto").strip().lower() or "auto"
    if value not in BACKENDS:
        raise ValueError(f"{BACKEND_VARIABLE}={value!r} is not allowed; use one of {', '.join(BACKENDS)}")
    return value


def self_check_enabled() -> bool:
    """False when TUTEL_CUDA_SELF_CHECK is 0, off, false or no."""
    return os.environ.get(SELF_CHECK_VARIABLE, "1").strip().lower() not in ("0", "off", "false", "no")


class Choice(NamedTuple):
    """The implementation of one operator on one device, and why."""

    implementation: str  # KERNELS or COMPOSITE
    reason: str


def cuda_kernels_unavailable() -> Optional[str]:
    """Why tutel's CUDA kernels cannot run in this process, or None if they can be tried."""
    extension = load_extension()
    if not extension.with_cuda:
        return "tutel was built without CUDA support"
    try:
        extension._cuda_nvrtc_info()
    except RuntimeError as error:
        return "NVRTC cannot be loaded: " + str(error).splitlines()[0]
    return None


def fake_mode_active() -> bool:
    """True inside a FakeTensorMode, where operators run their shape functions only: a fake CUDA
    tensor then takes the path a CUDA build takes (the compiled operators' fake kernels)."""
    return _FAKE_KEY is not None and _ACTIVE_MODE(_FAKE_KEY) is not None


# The compute capability a fake CUDA tensor stands for when this PyTorch has no CUDA to ask: a
# Hopper GPU (H100 / H200), the device the CUDA path is tuned for, so a trace on the CPU takes the
# path that device takes.
FAKE_CUDA_CAPABILITY = (9, 0)


def cuda_capability(device: torch.device) -> tuple:
    """(major, minor) compute capability of the CUDA `device`; FAKE_CUDA_CAPABILITY inside a
    FakeTensorMode on a PyTorch without CUDA."""
    if not torch.cuda.is_available() and fake_mode_active():
        return FAKE_CUDA_CAPABILITY
    return torch.cuda.get_device_capability(device)


def _self_check_impossible(device: torch.device) -> bool:
    """True while tracing, capturing or running on fake tensors, when the check cannot run kernels
    and compare results."""
    if fake_mode_active() or is_compiling():  # (fake first: a trace on fake tensors asks for every operator)
        return True
    # (A CPU-only PyTorch has no capture state to ask about.)
    return device.type == "cuda" and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class DeviceBackends:
    """The per-device choice between `kernels` and `composite` (objects with the
    operators as attributes, like ``torch.ops.tutel``), made once per device.

    Args:
        kernels: the compiled operators.
        composite: the composite operators (the trusted fallback).
        kernels_unavailable: returns why the kernels cannot be used at all, or None.
        check: compares ``kernels`` with ``composite`` on a device; returns per operator
            None or the disagreement (see tutel.ops.self_check.compare_operators).
    """

    def __init__(self, kernels, composite_ops=composite,
                 kernels_unavailable: Callable[[], Optional[str]] = cuda_kernels_unavailable,
                 check: Callable[..., Dict[str, Optional[str]]] = compare_operators):
        self._kernels = kernels
        self._composite = composite_ops
        self._kernels_unavailable = kernels_unavailable
        self._check = check
        self._lock = threading.Lock()
        self._operators: Dict[str, SimpleNamespace] = {}
        self._choices: Dict[str, Dict[str, Choice]] = {}
        self._unchecked: Dict[Optional[str], object] = {}  # unchecked() by TUTEL_CUDA_BACKEND's value

    def operators(self, device: torch.device):
        """The operators to use for tensors on `device` (choosing them on first use)."""
        key = str(device)
        chosen = self._operators.get(key)
        if chosen is not None:
            return chosen
        if _self_check_impossible(device):
            # No check now, and no choice kept: the next eager call chooses.
            return self.unchecked()
        with self._lock:
            if key not in self._operators:
                choices = self._choose(device)
                self._choices[key] = choices
                self._operators[key] = SimpleNamespace(**{
                    name: getattr(self._kernels if choice.implementation == KERNELS else self._composite, name)
                    for name, choice in choices.items()})
            return self._operators[key]

    def unchecked(self):
        """The operators used where no check can run (tracing, capture, fake tensors): the composite
        ones if TUTEL_CUDA_BACKEND says so, else the kernels."""
        return self._composite if requested_backend() == COMPOSITE else self._kernels

    def choices(self) -> Dict[str, Dict[str, Choice]]:
        """The choices made so far: {device: {operator: Choice}}."""
        return {device: dict(choices) for device, choices in self._choices.items()}

    def forget(self) -> None:
        """Drops every choice, so the next use of each device chooses (and checks) again."""
        with self._lock:
            self._operators.clear()
            self._choices.clear()
            self._unchecked.clear()

    def _choose(self, device: torch.device) -> Dict[str, Choice]:
        backend = requested_backend()
        if backend != "auto":
            return {name: Choice(backend, f"{BACKEND_VARIABLE}={backend}") for name in OPERATORS}
        unavailable = self._kernels_unavailable()
        if unavailable is not None:
            warnings.warn(f"tutel: the CUDA kernels cannot be used on {device} ({unavailable}); tutel uses its "
                          f"composite PyTorch operators there instead (slower; set {BACKEND_VARIABLE}=composite "
                          "to choose them without this warning).", RuntimeWarning, stacklevel=4)
            return {name: Choice(COMPOSITE, unavailable) for name in OPERATORS}
        if not self_check_enabled():
            return {name: Choice(KERNELS, f"self-check off ({SELF_CHECK_VARIABLE}=0)") for name in OPERATORS}
        with torch.no_grad():
            failures = self._check(self._kernels, self._composite, device)
        choices = {name: Choice(COMPOSITE, f"self-check failed: {failures[name]}") if failures.get(name)
                   else Choice(KERNELS, "self-check passed") for name in OPERATORS}
        failed = [name for name in OPERATORS if failures.get(name)]
        if failed:
            details = "; ".join(f"{name}: {failures[name]}" for name in failed)
            warnings.warn(f"tutel: the CUDA kernel{'s' if len(failed) > 1 else ''} of {', '.join(failed)} "
                          f"disagreed with the composite PyTorch operators on {device} in the self-check "
                          f"({details}). tutel uses the composite operators for "
                          f"{'them' if len(failed) > 1 else 'it'} on {device} from now on. Please report this "
                          "with the output of `python -m tutel.check`.", RuntimeWarning, stacklevel=4)
        return choices


def compiled_operators():
    """The compiled operators, ``torch.ops.tutel``: an object with every registered operator as an
    attribute, each running the implementation of its tensors' device (the CUDA kernels unchecked,
    whatever the self-check chose).  For the callers outside tutel.ops that compare or time them
    against the composite ones (``python -m tutel.check``); the layer's paths take
    ``operators_for(device)`` or tutel.ops.direct instead."""
    return torch.ops.tutel


CUDA_BACKENDS = DeviceBackends(torch.ops.tutel)
_forced = None  # an operator set used on every device (see use_operators)
# Devices with compiled operators besides CUDA ("meta": the shape functions torch.compile traces).
_COMPILED_DEVICE_TYPES = ("cpu", "meta")


def operators_for(device: torch.device):
    """The implementation of tutel's operators for tensors on `device`: an object with
    ``route_topk``, ``assign_locations``, ``cumsum_sub_one``, ``gather_slots`` and
    ``scatter_slots`` taking the arguments of ``torch.ops.tutel``'s operators."""
    if _forced is not None:
        return _forced
    kind = device.type
    if kind == "cuda":
        # The warm cases inline (every operator of a call asks): a device whose choice is made, and
        # fake tensors, which take the compiled operators' fake kernels unchecked.
        chosen = CUDA_BACKENDS._operators.get(str(device))
        if chosen is not None:
            return chosen
        if _FAKE_KEY is not None and _ACTIVE_MODE(_FAKE_KEY) is not None:
            setting = os.environ.get(BACKEND_VARIABLE)
            chosen = CUDA_BACKENDS._unchecked.get(setting)
            if chosen is None:
                chosen = CUDA_BACKENDS._unchecked[setting] = CUDA_BACKENDS.unchecked()
            return chosen
        return CUDA_BACKENDS.operators(device)
    if kind in _COMPILED_DEVICE_TYPES:
        return torch.ops.tutel
    return composite  # a device tutel has no compiled operators for (mps, xpu, ...)


@contextlib.contextmanager
def use_operators(implementation: str) -> Iterator[None]:
    """Within the block, every device uses `implementation`: "composite" (the PyTorch
    operators, e.g. to compare them with the compiled ones on the CPU) or "native"
    (the compiled operators, unchecked).  Not thread-local: meant for tests and checks."""
    global _forced
    if implementation not in ("composite", "native"):
        raise ValueError(f"tutel.ops.backend.use_operators: implementation must be 'composite' or 'native', "
                         f"got {implementation!r}")
    previous = _forced
    _forced = composite if implementation == "composite" else torch.ops.tutel
    try:
        yield
    finally:
        _forced = previous
