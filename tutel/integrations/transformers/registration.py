"""Registration of the "tutel" experts implementation with transformers, and an up-front check
of a model's experts modules."""
from typing import List

import torch

from .forward import tutel_experts_forward
from .layout import FLAGS, read_layout

NAME = "tutel"


def register() -> None:
    """Adds ``tutel_experts_forward`` to transformers' ExpertsInterface under the name "tutel", so
    ``from_pretrained(..., experts_implementation="tutel")`` and
    ``model.set_experts_implementation("tutel")`` accept it.  Idempotent."""
    from transformers.integrations.moe import ExpertsInterface
    ExpertsInterface.register(NAME, tutel_experts_forward)


def experts_modules(model: torch.nn.Module) -> List[torch.nn.Module]:
    """The experts modules of `model` that transformers dispatches by ``experts_implementation``
    (those whose class carries the decorator's flags)."""
    return [module for module in model.modules() if all(hasattr(module, flag) for flag in FLAGS[:5])]


def check_model(model: torch.nn.Module) -> int:
    """Checks every experts module of `model` now rather than at its first call; returns how
    many there are.

    Raises:
        UnsupportedExpertsLayout: naming the first module class and flag tutel cannot run.
    """
    modules = experts_modules(model)
    for module in modules:
        read_layout(module)
    return len(modules)


def enable(model: torch.nn.Module) -> torch.nn.Module:
    """``model.set_experts_implementation("tutel")`` after checking every experts module of the
    model (so an unsupported layout fails here, not at the first forward); returns `model`."""
    register()
    check_model(model)
    model.set_experts_implementation(NAME)
    return model
