"""Registration of the "tutel" experts implementation with transformers, and an up-front check
of a model's experts modules."""
import warnings
from typing import List, Tuple

import torch

from .forward import tutel_experts_forward
from .layout import is_dispatched, read_layout
from .replace import find_moe_blocks

NAME = "tutel"


class NoExpertsModule(ValueError):
    """A model none of whose experts modules transformers runs through an experts implementation,
    so that nothing of it would run through tutel."""


def register() -> None:
    """Adds ``tutel_experts_forward`` to transformers' ExpertsInterface under the name "tutel", so
    ``from_pretrained(..., experts_implementation="tutel")`` and
    ``model.set_experts_implementation("tutel")`` accept it.  Idempotent."""
    from transformers.integrations.moe import ExpertsInterface
    ExpertsInterface.register(NAME, tutel_experts_forward)


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
        read_layout(module)
    if others:
        warnings.warn(f'experts_implementation="{NAME}": {type(model).__name__}: {_listed(others)} are not declared '
                      f"with transformers' @use_experts_implementation and keep their own forward; the other "
                      f"{len(modules)} experts modules run through tutel", UserWarning, stacklevel=2)
    return len(modules)


def enable(model: torch.nn.Module) -> torch.nn.Module:
    """``model.set_experts_implementation("tutel")`` after checking every experts module of the
    model (so an unsupported layout, or a model with no experts module tutel can run, fails here,
    not silently or at the first forward); returns `model`."""
    register()
    check_model(model)
    model.set_experts_implementation(NAME)
    return model
