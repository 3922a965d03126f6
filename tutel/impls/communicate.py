"""Tutel's module path for the distributed helpers: a re-export of :mod:`tutel.collectives`,
so ``from tutel.impls.communicate import ...`` keeps working in code written for Tutel."""
from ..collectives import *  # noqa: F401,F403
from ..collectives import __all__  # noqa: F401
