"""A transformers experts module's experts as tutel runs them, read once per state of the module.

Decoding a token costs about the time it takes to stream the chosen experts' weights, and the
caches are cold by then (each layer's weights pushed the last layer's code and data out).  Cold,
every Python statement costs a visible share of a decoding step, and reading and checking a
module's layout (``read_layout``: its flags, tensors, shapes and gate rule) is many of them.  So the
layout is read once and kept with the objects it was read from (the class and its gate rule, the
module's instance attributes, parameters and submodules); a later call whose module still holds the
same objects uses it as it is.  Any of them replaced, added or removed and it is read again; a
layout that depends on something those objects do not show (a tensor outside the parameters, a
class attribute) is read on every call.
"""
import weakref
from typing import Callable, Optional, Tuple, TypeVar

import torch

from ...experts.routed import gate_unit_of
from ...ops.gated_units import GatedUnit, check_unit
from ...paths import WeightExperts
from .layout import ExpertsLayout, read_layout

# What read_layout reads besides tensors and flags; cached only where each is on the instance (or,
# for act_fn, among its submodules), where kept_layout sees a change.
_SCALARS_AND_FUNCTIONS = ("num_experts", "alpha", "limit", "act_fn")


class KeptLayout:
    """What a module's layout gives a call: its tensors (by weak reference where the layout is kept:
    a kept layout must not keep replaced weights alive), the rules between its products, and its
    sizes."""
    __slots__ = ("tensors", "weak", "transposed", "unit", "gate_fn", "activation", "post_fn", "num_experts",
                 "expert_parallel", "model_dim")

    def __init__(self, layout: ExpertsLayout, on_death: Optional[Callable] = None, weak: bool = True):
        tensors = (layout.up_weight, layout.down_weight, layout.up_bias, layout.down_bias)
        self.tensors = tuple(None if t is None else weakref.ref(t, on_death) for t in tensors) if weak else tensors
        self.weak = weak
        self.transposed = bool(layout.transposed)
        self.unit: Optional[GatedUnit] = gate_unit_of(layout.gate)
        if self.unit is not None:
            check_unit(self.unit, 'experts_implementation="tutel"')
        self.gate_fn, self.activation, self.post_fn = layout.gate_fn, layout.activation, layout.post_fn
        self.num_experts, self.expert_parallel, self.model_dim = \
            layout.num_experts, layout.expert_parallel, layout.model_dim

    def experts(self) -> WeightExperts:
        """The experts with the module's tensors as they are now."""
        up, down, up_bias, down_bias = self.tensors
        if self.weak:  # (one by one: a generator costs a call per tensor)
            up, down = up(), down()
            up_bias = None if up_bias is None else up_bias()
            down_bias = None if down_bias is None else down_bias()
        return WeightExperts(up, down, up_bias, down_bias, self.transposed, self.unit, self.gate_fn,
                             self.activation, self.post_fn)


class _Entry:
    """The layout kept on a module, in its ``__dict__`` (a reference back to the module, e.g. a
    bound gate rule, then makes an ordinary collectable cycle).  ``key`` holds the ids of the objects
    kept_layout reads; ``guards`` keeps them from being reused: the other objects by strong
    reference, the tensors by weak references whose death clears the key.  Copies and pickles of
    the module start with an empty entry."""
    __slots__ = ("key", "guards", "read")

    def __init__(self):
        self.key: Optional[Tuple[int, ...]] = None
        self.guards: tuple = ()
        self.read: Optional[KeptLayout] = None

    def __reduce__(self):
        return _Entry, ()

    def forget(self, _dead_reference: object = None) -> None:
        self.key = None


_ENTRY = "_tutel_experts"


def seen_by_key(module: torch.nn.Module, tensors, names) -> bool:
    """Whether a reading that depends on `tensors` and the attributes `names` of `module` can be
    kept: every tensor a parameter of the module, every name on the instance (or, for a function,
    among its submodules) or absent, so that the key of kept_layout / kept_reading sees a change."""
    attributes = module.__dict__
    parameters, submodules = attributes.get("_parameters", {}).values(), attributes.get("_modules", {})
    if not all(any(t is p for p in parameters) for t in tensors if t is not None):
        return False
    return not any(hasattr(module, name) and name not in attributes and name not in submodules for name in names)


def _cacheable(module: torch.nn.Module, layout: ExpertsLayout) -> bool:
    """Whether every object the layout depends on is one kept_layout sees: its tensors parameters of the
    module, its scalars and activation on the instance."""
    return seen_by_key(module, (layout.up_weight, layout.down_weight, layout.up_bias, layout.down_bias),
                       _SCALARS_AND_FUNCTIONS)


def _held(module: torch.nn.Module) -> tuple:
    """Every object a reading of `module` can depend on: the class and its gate rule, the module's
    instance attributes (the flags among them), parameters and submodules."""
    attributes = module.__dict__
    cls = type(module)
    return (cls, getattr(cls, "_apply_gate", None), *attributes.values(),
            *attributes.get("_parameters", {}).values(), *attributes.get("_modules", {}).values())


Reading = TypeVar("Reading")


def kept_reading(module: torch.nn.Module, entry_name: str,
                 read: Callable[[torch.nn.Module, Optional[Callable]], Tuple[Reading, bool]]) -> Reading:
    """What ``read(module, on_death)`` returns, kept in the module's attribute `entry_name` while the
    module holds the objects it was read from (kept_layout's rule, for other readers: transformers'
    FP8 experts).  `read` returns (reading, whether it may be kept: seen_by_key) and holds the
    module's tensors by weak references calling `on_death` (None: it may hold them strongly, as
    under torch.compile, where nothing is kept)."""
    if torch.compiler.is_compiling():
        return read(module, None)[0]
    attributes = module.__dict__
    entry = attributes.get(entry_name)
    if entry is None:  # (set before the attributes are read, so that it is one of them from the start)
        entry = attributes[entry_name] = _Entry()
    held = _held(module)
    key = tuple(map(id, held))
    if entry.key == key:
        return entry.read
    entry.key = None
    reading, cacheable = read(module, entry.forget)
    if cacheable:
        entry.read = reading
        entry.guards = tuple(weakref.ref(o, entry.forget) if isinstance(o, torch.Tensor) else o for o in held)
        entry.key = key
    return reading


def kept_layout(module: torch.nn.Module) -> KeptLayout:
    """The layout of `module` (a transformers experts module), kept while the module holds the
    objects it was read from.  Raises UnsupportedExpertsLayout (read_layout's).  (kept_reading's
    rule written out: this runs on every call of every float experts module, where each Python
    call counts.)"""
    if torch.compiler.is_compiling():  # traced once: the layout read in the trace, nothing kept
        return KeptLayout(read_layout(module), weak=False)
    attributes = module.__dict__
    entry = attributes.get(_ENTRY)
    if entry is None:  # (set before the attributes are read, so that it is one of them from the start)
        entry = attributes[_ENTRY] = _Entry()
    # Every object read_layout's result can depend on: the class and its gate rule, the module's
    # instance attributes (the flags among them), parameters and submodules.
    cls = type(module)
    held = (cls, getattr(cls, "_apply_gate", None), *attributes.values(),
            *attributes.get("_parameters", {}).values(), *attributes.get("_modules", {}).values())
    key = tuple(map(id, held))
    if entry.key == key:
        return entry.read
    entry.key = None
    layout = read_layout(module)
    read = KeptLayout(layout, entry.forget)
    if _cacheable(module, layout):
        entry.read = read
        entry.guards = tuple(weakref.ref(o, entry.forget) if isinstance(o, torch.Tensor) else o for o in held)
        entry.key = key
    return read
