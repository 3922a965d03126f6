"""Registration of the "tutel" experts implementation with transformers, and an up-front check
of a model's experts modules."""
import warnings
from typing import Callable, List, Optional, Tuple

import torch

from ...ops.quantized_experts import ACTIVATIONS
from .forward import tutel_experts_forward
from .fp8_experts import FP8_ACTIVATIONS, is_fp8_experts, read_fp8_layout, tutel_fp8_experts_forward
from .layout import is_dispatched, read_layout
from .replace import find_moe_blocks

NAME = "tutel"


class NoExpertsModule(ValueError):
    """A model none of whose experts modules transformers runs through an experts implementation,
    so that nothing of it would run through tutel."""


def experts_registries() -> List[Tuple[type, Callable]]:
    """(registry class, the forward "tutel" names there) for every experts registry of the installed
    transformers: ``ExpertsInterface`` (``ALL_EXPERTS_FUNCTIONS``) with the float experts' forward,
    and each subclass with a mapping of its own (``FP8ExpertsInterface``, whose
    ``ALL_FP8_EXPERTS_FUNCTIONS`` dispatches ``FP8Experts``, since 5.7; any such registry a release
    adds) with the FP8 experts' forward, which names what it cannot run rather than leaving the name
    unknown there.  A subclass sharing its parent's mapping is reached through the parent."""
    from transformers.integrations.moe import ExpertsInterface
    try:  # (imported for its registry; transformers' modeling_utils imports it too)
        import transformers.integrations.finegrained_fp8  # noqa: F401
    except ImportError:
        pass
    found = [(ExpertsInterface, tutel_experts_forward)]
    pending = list(ExpertsInterface.__subclasses__())
    while pending:
        registry = pending.pop(0)
        pending.extend(registry.__subclasses__())
        if "_global_mapping" in vars(registry):
            found.append((registry, tutel_fp8_experts_forward))
    return found


def register() -> None:
    """Adds "tutel" to every experts registry of the installed transformers (experts_registries):
    ``from_pretrained(..., experts_implementation="tutel")`` and
    ``model.set_experts_implementation("tutel")`` accept it, and every experts module they dispatch
    finds it (transformers' FP8 experts look it up in a registry of their own).  Idempotent."""
    for registry, forward in experts_registries():
        registry.register(NAME, forward)


def experts_modules(model: torch.nn.Module) -> List[torch.nn.Module]:
    """The experts modules of `model` that transformers dispatches by ``experts_implementation``
    (those whose class is declared with ``@use_experts_implementation``)."""
    return [module for module in model.modules() if is_dispatched(module)]


def undispatched_experts(model: torch.nn.Module) -> List[Tuple[str, torch.nn.Module]]:
    """(name, module) of the routed experts of `model` that transformers runs with their own
    forward whatever ``experts_implementation`` says (e.g. Llama 4's ``Llama4TextExperts``, which
    expect tokens already grouped by expert)."""
    return [(f"{name}.experts", block.experts) for name, block in find_moe_blocks(model)
            if not is_dispatched(block.experts)]


def _listed(modules: List[Tuple[str, torch.nn.Module]], most: int = 3) -> str:
    shown = ", ".join(f"'{name}' ({type(module).__name__})" for name, module in modules[:most])
    return shown + (f" and {len(modules) - most} more" if len(modules) > most else "")


def check_model(model: torch.nn.Module) -> int:
    """Checks every experts module of `model` now rather than at its first call; returns how
    many there are.  Warns (once) when some of the model's routed experts are not run through
    an experts implementation (they keep transformers' own forward).

    Raises:
        UnsupportedExpertsLayout: naming the first module class and flag tutel cannot run.
        NotImplementedError: FP8 experts tutel cannot run yet (activation_scheme="static").
        NoExpertsModule: naming the model class, when none of its modules would run through tutel
            (a dense model, or one whose experts transformers does not dispatch).
    """
    modules = experts_modules(model)
    others = undispatched_experts(model)
    if not modules:
        found = (f"its routed experts ({_listed(others)}) are not declared with transformers' "
                 f"@use_experts_implementation, so transformers runs them with their own forward; "
                 f"tutel.integrations.transformers.replace_moe_blocks(model) can replace such blocks") if others \
            else "no module of it is an experts class declared with transformers' @use_experts_implementation"
        raise NoExpertsModule(f'experts_implementation="{NAME}": {type(model).__name__} has no experts module '
                              f"tutel can run: {found}")
    for module in modules:
        (read_fp8_layout if is_fp8_experts(module) else read_layout)(module)
    if others:
        warnings.warn(f'experts_implementation="{NAME}": {type(model).__name__}: {_listed(others)} are not declared '
                      f"with transformers' @use_experts_implementation and keep their own forward; the other "
                      f"{len(modules)} experts modules run through tutel", UserWarning, stacklevel=2)
    return len(modules)


def enable(model: torch.nn.Module, fp8_activations: Optional[str] = None) -> torch.nn.Module:
    """``model.set_experts_implementation("tutel")`` after checking every experts module of the
    model (so an unsupported layout, or a model with no experts module tutel can run, fails here,
    not silently or at the first forward); returns `model`.

    Args:
        model: a transformers model.
        fp8_activations: for transformers' FP8 experts (``FP8Experts``): None runs each module as
            its ``activation_scheme`` says ("dynamic": W8A8, activations quantized per token and
            block as transformers' kernels do); "weight_only" multiplies the dequantized weights
            with the activations unquantized; "dynamic" forces W8A8.  Set on every FP8 experts
            module (a ValueError where the model has none)."""
    register()
    if fp8_activations is not None:
        if fp8_activations not in ACTIVATIONS:
            raise ValueError(f"enable: fp8_activations must be one of {ACTIVATIONS} or None, got {fp8_activations!r}")
        fp8 = [module for module in experts_modules(model) if is_fp8_experts(module)]
        if not fp8:
            raise ValueError(f"enable: fp8_activations={fp8_activations!r} applies to transformers' FP8 experts "
                             f"(FP8Experts), and {type(model).__name__} has none")
        for module in fp8:
            setattr(module, FP8_ACTIVATIONS, fp8_activations)
    check_model(model)
    model.set_experts_implementation(NAME)
    return model
