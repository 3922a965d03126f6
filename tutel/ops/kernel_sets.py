"""The run-time choice among a compiled CPU operator's kernel sets ("amx", "avx512_bf16", "avx512",
"avx2", "portable"): the widest the CPU runs by default, any other it runs on request, for tests that
hold every set to the same reference and for measurements that compare them."""
import contextlib
from typing import Iterator, Tuple

from .extension import load_extension


class KernelSets:
    """The kernel sets of one operator, read and chosen through the extension's three functions
    ``_<prefix>_kernels``, ``_<prefix>_kernel_sets`` and ``_set_<prefix>_kernels``."""

    def __init__(self, prefix: str):
        self._prefix = prefix

    def current(self) -> str:
        """The kernel set the operator runs now."""
        return getattr(load_extension(), f"_{self._prefix}_kernels")()

    def available(self) -> Tuple[str, ...]:
        """The kernel sets this CPU runs, widest first (``"portable"`` always last)."""
        return tuple(getattr(load_extension(), f"_{self._prefix}_kernel_sets")())

    def choose(self, name: str) -> None:
        """Makes the operator run the `name` kernels from now on, in every thread of the process:
        ``"best"`` (the widest this CPU runs, the default) or one of ``available()``.

        Raises ValueError for any other name."""
        if not isinstance(name, str):
            raise ValueError(f"`name` must be 'best' or one of {self.available()}, got {name!r}")
        getattr(load_extension(), f"_set_{self._prefix}_kernels")(name)

    @contextlib.contextmanager
    def using(self, name: str) -> Iterator[None]:
        """Runs the block's calls on the `name` kernels (see ``choose``), then goes back to the best
        ones."""
        self.choose(name)
        try:
            yield
        finally:
            self.choose("best")
