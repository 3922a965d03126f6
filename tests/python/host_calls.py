"""Counting the Python function calls one call of a function makes inside a package's files.

Much of the host cost of a small MoE call is Python: every function tutel's code runs between the
caller and the operators.  ``count_tutel_calls(fn, *args)`` runs ``fn(*args)`` once under cProfile
and counts the calls of every Python function whose source file lies in tutel's package directory
(primitive and recursive calls alike: cProfile's ``ncalls``), next to all Python calls and all
calls of C functions (builtins, PyTorch's bindings).  The count is deterministic where the call is:
warm ``fn`` up first (caches filled, kernels chosen), as a steady-state caller would have.

cProfile counts a generator's every resumption as a call, and a comprehension (a function of its
own before Python 3.12) as one call; both are work the interpreter does per call, so both count.

On a machine without a GPU the CUDA path runs on fake tensors (``fake_cuda()``): the operators run
their shape functions only, so tutel's own shape functions (registered with ``register_fake``) run
there where a real GPU would run kernels instead.  ``shape_function_keys`` names them, so that a
report can tell them apart; the count itself leaves nothing out.
"""
import contextlib
import cProfile
import os
import pstats
import types
from typing import Callable, Dict, FrozenSet, Iterator, List, NamedTuple, Optional, Tuple

from benchmark_scripts import load_script

FunctionKey = Tuple[str, int, str]  # (file, first line, name): how pstats names a function


class FunctionCalls(NamedTuple):
    """One function's calls in a counted run."""

    calls: int
    file: str  # relative to the counted package's directory
    line: int
    name: str

    def label(self) -> str:
        """``file:line(name)``, as cProfile prints a function."""
        return f"{self.file}:{self.line}({self.name})"


class CallCount(NamedTuple):
    """What one counted call made.

    package_calls: calls of Python functions defined in the package's files;
    python_calls:  calls of Python functions anywhere (the package's, PyTorch's, the caller's own);
    builtin_calls: calls of C functions (builtins, methods of C types, PyTorch's bindings);
    by_function:   the package's functions with their calls, most called first (ties by file and line);
    package_dir:   the directory counted (absolute, symbolic links resolved)."""

    package_calls: int
    python_calls: int
    builtin_calls: int
    by_function: Tuple[FunctionCalls, ...]
    package_dir: str

    def breakdown(self, limit: Optional[int] = 20) -> str:
        """The `limit` most called functions of the package (all with None), one a line:
        ``calls  file:line(name)``."""
        rows = self.by_function if limit is None else self.by_function[:limit]
        width = len(str(rows[0].calls)) if rows else 1
        return "\n".join(f"{row.calls:>{width}}  {row.label()}" for row in rows)

    def calls_of(self, keys: FrozenSet[FunctionKey]) -> int:
        """How many of the package's calls went to the functions named in `keys` (absolute file, line, name)."""
        return sum(row.calls for row in self.by_function
                   if (os.path.join(self.package_dir, row.file), row.line, row.name) in keys)


def tutel_package_dir() -> str:
    """The directory of the tutel package imported in this process (symbolic links resolved)."""
    import tutel
    return os.path.realpath(os.path.dirname(os.path.abspath(tutel.__file__)))


def count_calls_under(package_dir: str, fn: Callable[..., object], *args, **kwargs) -> CallCount:
    """Runs ``fn(*args, **kwargs)`` once under cProfile and counts the Python calls whose code lies in
    `package_dir` (or any directory below it); see CallCount.  An exception from `fn` propagates."""
    root = os.path.realpath(os.path.abspath(package_dir))
    profiler = cProfile.Profile()
    profiler.runcall(fn, *args, **kwargs)
    return _tally(pstats.Stats(profiler).stats, root)


def count_tutel_calls(fn: Callable[..., object], *args, **kwargs) -> CallCount:
    """count_calls_under(tutel_package_dir(), fn, *args, **kwargs): one call of `fn`, counted in tutel's
    own files.  Warm `fn` up first: a first call fills caches and is not what a caller pays per call."""
    return count_calls_under(tutel_package_dir(), fn, *args, **kwargs)


def _tally(stats: Dict[FunctionKey, tuple], root: str) -> CallCount:
    inside: List[FunctionCalls] = []
    python_calls = builtin_calls = 0
    resolved: Dict[str, Optional[str]] = {}
    for (filename, line, name), (_primitive, calls, *_rest) in stats.items():
        # cProfile files C functions under "~" (line 0); everything else is a Python code object.
        if filename == "~" and line == 0:
            builtin_calls += calls
            continue
        python_calls += calls
        if filename not in resolved:
            resolved[filename] = _relative_inside(filename, root)
        relative = resolved[filename]
        if relative is not None:
            inside.append(FunctionCalls(calls, relative, line, name))
    inside.sort(key=lambda row: (-row.calls, row.file, row.line, row.name))
    return CallCount(sum(row.calls for row in inside), python_calls, builtin_calls, tuple(inside), root)


def _relative_inside(filename: str, root: str) -> Optional[str]:
    """`filename` relative to `root` when the file lies under it, else None (also for pseudo-files
    such as ``<string>``)."""
    if filename.startswith("<"):
        return None
    path = os.path.realpath(os.path.abspath(filename))
    try:
        if os.path.commonpath([path, root]) != root:
            return None
    except ValueError:  # different drives
        return None
    return os.path.relpath(path, root)


# ---------------------------------------------------------------------------------- fake CUDA

def shape_function_keys(package_dir: Optional[str] = None) -> FrozenSet[FunctionKey]:
    """The functions of the package (tutel's by default) registered as operators' shape functions
    (``torch.library.register_fake``, ``CustomOpDef.register_fake``), as (absolute file, first line,
    name): what runs under fake tensors where a GPU would run a kernel.

    Read from PyTorch's private registry of Python kernels; where a release keeps it otherwise the
    set is empty (a report then shows none, the count is unaffected)."""
    root = os.path.realpath(package_dir or tutel_package_dir())
    keys = set()
    try:
        from torch._library import simple_registry
        entries = list(simple_registry.singleton._data.values())
    except (ImportError, AttributeError):
        return frozenset()
    registered = [getattr(getattr(getattr(entry, "fake_impl", None), "kernel", None), "func", None)
                  for entry in entries]
    try:  # operators defined with torch.library.custom_op keep their shape function themselves
        from torch._library.custom_ops import OPDEFS
        registered += [getattr(definition, "_abstract_fn", None) for definition in OPDEFS.values()]
    except ImportError:
        pass
    for kernel in registered:
        function = _registered_within(kernel, root)
        if function is not None:
            code = function.__code__
            keys.add((os.path.realpath(code.co_filename), code.co_firstlineno, code.co_name))
    return frozenset(keys)


def _registered_within(function: object, root: str, depth: int = 3) -> Optional[types.FunctionType]:
    """The first function under `root` reached from `function` through the wrappers PyTorch's
    registration puts around a shape function (``__wrapped__``, a closure's cells), a few levels
    down; None when none is."""
    if not isinstance(function, types.FunctionType) or depth < 0:
        return None
    if _relative_inside(function.__code__.co_filename, root) is not None:
        return function
    inner = [getattr(function, "__wrapped__", None)]
    inner += [cell.cell_contents for cell in (function.__closure__ or ()) if _cell_filled(cell)]
    for candidate in inner:
        found = _registered_within(candidate, root, depth - 1)
        if found is not None:
            return found
    return None


def _cell_filled(cell) -> bool:
    try:
        cell.cell_contents
    except ValueError:  # an empty cell
        return False
    return True


@contextlib.contextmanager
def fake_cuda() -> Iterator[object]:
    """A FakeTensorMode in which tensors made on "cuda" are fake CUDA tensors (shape functions
    only; a host read or a data-dependent shape raises, as it would break CUDA-graph capture).

    Unlike launch_count.fake_cuda this neither builds and loads the guard that lets autograd record
    graphs of fake CUDA tensors nor wraps ``torch.autograd.Function.apply`` (the wrapper's own calls
    would show in ``python_calls``; ``package_calls`` would not change): it is for inference calls
    (torch.no_grad), which record no graph.  Make modules' parameters fake with
    launch_count.fake_parameters; for a training step use launch_count.fake_cuda."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode(allow_non_fake_inputs=False) as mode:
        yield mode


def load_host_cost_benchmark() -> types.ModuleType:
    """benchmarks/host_cost.py as a fresh module (benchmarks/ on sys.path for its own imports): its
    cases are the calls the tests count."""
    return load_script("host_cost")
