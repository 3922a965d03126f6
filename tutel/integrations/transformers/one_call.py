"""The "tutel" experts forward's shortcut for CPU inference: one operator call, little Python around it.

Decoding a token costs about the time it takes to stream the chosen experts' weights, and the
caches are cold by then (each layer's weights pushed the last layer's code and data out).  Cold,
every Python statement and operator call costs a visible share of a decoding step: reading the
module's layout, checking the arguments, choosing the path and the dispatcher among them.

Here a module's layout is read once and kept together with the objects it was read from (the
class, flags, parameters, activation); a later call whose module still holds the same objects
and whose arguments suit ``tutel::routed_gated_experts`` (plain CPU tensors, no autograd, no
autocast, no tracing, one dtype, few rows) calls the operator's CPU implementation directly.  It
checks every argument itself; when it refuses one, the full path (``tutel_experts_forward``) runs
and raises its own descriptive error.  Any other call returns None here and takes the full path.
"""
import weakref
from typing import NamedTuple, Optional, Tuple

import torch

from ...experts.routed import gate_unit_of
from ...ops.direct import routed_gated_experts_cpu
from ...ops.gated_units import GatedUnit, check_unit, unit_scalars
from ...ops.precision import gemm_dtype
from ...ops.tracing import direct_call_allowed, is_compiling
from ...paths.facts import experts_facts
from ...rules.autocast import autocast_dtype
from ...rules.paths import EXPERTS, Path, choose_path
from .layout import read_layout

# One C call for "no autocast anywhere" (cold, torch.is_autocast_enabled("cpu") costs 12 us more).
_ANY_AUTOCAST = getattr(torch._C, "_is_any_autocast_enabled", None) or (lambda: autocast_dtype("cpu") is not None)

# What read_layout reads besides tensors and flags; the fast path needs each on the instance (or, for
# act_fn, among its submodules), where _held sees a change.
_SCALARS_AND_FUNCTIONS = ("num_experts", "alpha", "limit", "act_fn")


class _OneCall(NamedTuple):
    """A module's operator arguments besides the call's three tensors; its tensors by weak reference
    (a cached layout must not keep replaced weights alive)."""
    tensors: Tuple[Optional[weakref.ref], ...]  # up_weight, down_weight, up_bias, down_bias
    transposed: bool
    unit: GatedUnit
    unit_arguments: tuple  # (alpha, up_offset, limit, interleaved)


class _Entry:
    """The layout cached on a module, in its ``__dict__`` (a reference back to the module, e.g. a
    hook's ``forward`` attribute, then makes an ordinary collectable cycle).  ``key`` holds the ids
    of _held's objects; ``guards`` keeps them from being reused: the other objects by strong
    reference, the tensors by weak references whose death clears the key.  Copies and pickles of
    the module start with an empty entry."""
    __slots__ = ("key", "guards", "one_call")

    def __init__(self):
        self.key: Optional[Tuple[int, ...]] = None
        self.guards: tuple = ()
        self.one_call: Optional[_OneCall] = None

    def __reduce__(self):
        return _Entry, ()

    def forget(self, _dead_reference: object = None) -> None:
        self.key = None


_ENTRY = "_tutel_one_call"


def _held(module: torch.nn.Module) -> tuple:
    """Every object read_layout's result can depend on: the class and its gate rule, the module's
    instance attributes (the flags among them), parameters and submodules.  Any of them replaced,
    added or removed and the layout is read again."""
    attributes = module.__dict__
    cls = type(module)
    return (cls, getattr(cls, "_apply_gate", None), *attributes.values(),
            *attributes.get("_parameters", {}).values(), *attributes.get("_modules", {}).values())


def _read(module: torch.nn.Module, entry: _Entry) -> Optional[_OneCall]:
    """The module's operator arguments, or None when its experts need more than the operator does
    (their own gate rule, a post-expert norm, no gate) or keep what the layout depends on where
    _held does not look (a tensor outside the parameters, a class attribute).  Raises what
    read_layout raises."""
    layout = read_layout(module)
    unit = gate_unit_of(layout.gate)
    if unit is None or layout.post_fn is not None:
        return None
    check_unit(unit, "tutel.experts.routed_experts")
    attributes = module.__dict__
    parameters, submodules = attributes.get("_parameters", {}), attributes.get("_modules", {})
    tensors = (layout.up_weight, layout.down_weight, layout.up_bias, layout.down_bias)
    given = [t for t in tensors if t is not None]
    if not (direct_call_allowed(*given) and all(any(t is p for p in parameters.values()) for t in given)):
        return None
    if any(hasattr(module, name) and name not in attributes and name not in submodules
           for name in _SCALARS_AND_FUNCTIONS):
        return None
    return _OneCall(tuple(None if t is None else weakref.ref(t, entry.forget) for t in tensors),
                    bool(layout.transposed), unit, unit_scalars(unit) + (bool(unit.interleaved),))


def _one_call_of(module: torch.nn.Module) -> Optional[_OneCall]:
    attributes = module.__dict__
    entry = attributes.get(_ENTRY)
    if entry is None:  # (set before _held reads the attributes, so that it is one of them from the start)
        entry = attributes[_ENTRY] = _Entry()
    held = _held(module)
    key = tuple(map(id, held))
    if entry.key == key:
        return entry.one_call
    entry.key = None
    entry.one_call = _read(module, entry)
    entry.guards = tuple(weakref.ref(o, entry.forget) if isinstance(o, torch.Tensor) else o for o in held)
    entry.key = key
    return entry.one_call


def one_call_forward(module: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                     top_k_weights: torch.Tensor) -> Optional[torch.Tensor]:
    """The experts' output through one direct call of ``tutel::routed_gated_experts``' CPU
    implementation, or None where the call needs the full path (see the module docstring).

    Args:
        module: a transformers experts module (``@use_experts_implementation``).
        hidden_states, top_k_index, top_k_weights: the experts forward's arguments.

    Returns:
        [T, H] in ``hidden_states``' dtype, or None.

    Raises:
        UnsupportedExpertsLayout: as read_layout, for a module tutel cannot run.
    """
    if hidden_states is None or top_k_index is None or top_k_weights is None or is_compiling() or _ANY_AUTOCAST() \
            or not direct_call_allowed(hidden_states, top_k_index, top_k_weights) or not hidden_states.is_cpu:
        return None
    one_call = _one_call_of(module)
    if one_call is None:
        return None
    dtype = hidden_states.dtype
    up, down, up_bias, down_bias = one_call.tensors
    tensors = (up(), down(), up_bias and up_bias(), down_bias and down_bias())
    # Weights in another dtype or off the CPU (a parameter's .data may have changed since its layout
    # was read): the operator would refuse them, and an exception costs more than this look; 16-bit
    # weights that routed_experts widens on a CPU without 16-bit dot products.
    if any(t is not None and (t.dtype != dtype or not t.is_cpu) for t in tensors) or (
            dtype.itemsize == 2 and gemm_dtype(dtype, hidden_states.device,
                                               top_k_index.numel() / tensors[0].shape[0]) != dtype):
        return None
    # The chooser's facts for this call (the checks above are the direct call's own conditions: plain
    # CPU tensors, no autocast, the weights in the tokens' dtype); the path is the chooser's to pick.
    facts = experts_facts(hidden_states, top_k_index, top_k_weights, *tensors, one_call.unit, None)
    if choose_path(EXPERTS, facts).path is not Path.EXPERTS_ONE_CALL:
        return None
    try:
        return routed_gated_experts_cpu(hidden_states, top_k_index, top_k_weights, *tensors, one_call.transposed,
                                        *one_call.unit_arguments, None)
    except (TypeError, ValueError):  # refused arguments: the full path says what is wrong with them
        return None
