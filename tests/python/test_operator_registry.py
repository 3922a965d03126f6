"""tutel.ops.registry against the operators as registered: every operator of torch.ops.tutel is
listed once, the files and functions it names exist, the dispatch keys it implies are the
registered ones, the csrc files register what it says, and docs/operators.md is its table."""
import importlib
import inspect
import os
import pkgutil
import re
import subprocess
import sys
from typing import Dict, Set, Tuple

import pytest
import torch

import tutel.cuda
import tutel.ops
from tutel.ops import direct, registry

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
OPERATORS = registry.OPERATORS
NAMES = [operator.name for operator in OPERATORS]
_IMPL_BLOCK = re.compile(r"TORCH_LIBRARY_IMPL\(\s*tutel\s*,\s*(\w+)\s*,\s*m\s*\)\s*\{")


def _read(path: str) -> str:
    with open(os.path.join(REPO, path)) as handle:
        return handle.read()


def _has_kernel(name: str, key: str) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"{registry.NAMESPACE}::{name}", key)


def _given(value) -> bool:
    """True for a registry field that names something (not None, not 'none: why')."""
    return value is not None and not value.startswith(registry.NONE)


def _registrations_in_csrc() -> Dict[Tuple[str, str], str]:
    """{(dispatch key, operator): the csrc file whose TORCH_LIBRARY_IMPL(tutel, key) block registers it}."""
    found: Dict[Tuple[str, str], str] = {}
    for folder in ("csrc/ops/cpu", "csrc/ops/cuda"):
        for file_name in sorted(os.listdir(os.path.join(REPO, folder))):
            if not file_name.endswith(".cpp"):
                continue
            path = f"{folder}/{file_name}"
            text = _read(path)
            for match in _IMPL_BLOCK.finditer(text):
                depth, end = 1, match.end()
                while depth:  # the block's matching brace
                    depth += {"{": 1, "}": -1}.get(text[end], 0)
                    end += 1
                for name in re.findall(r'm\.impl\(\s*"(\w+)"', text[match.end():end]):
                    assert (match.group(1), name) not in found, f"{name} registered twice for {match.group(1)}"
                    found[(match.group(1), name)] = path
    return found


def _kernel_files() -> Dict[str, str]:
    """{kernel: the kernels/*.cu file defining it}, from csrc/cuda/kernel_params.h (generated from them)."""
    text = _read("csrc/cuda/kernel_params.h")
    return {name: "kernels/" + file_name for name, file_name in
            re.findall(r'struct (\w+) \{\s*static constexpr const char\* file = "([\w.]+)";', text)}


def test_every_registered_operator_is_listed_once():
    # Every module of tutel.ops imported: an operator defined in Python exists once its module ran.
    for module in pkgutil.walk_packages(tutel.ops.__path__, "tutel.ops."):
        importlib.import_module(module.name)
    assert len(NAMES) == len(set(NAMES))
    assert sorted(NAMES) == registry.registered_operators()


def test_the_compiled_operators_are_those_csrc_defines():
    defined = re.findall(r'm\.def\(\s*"(\w+)\(', _read("csrc/ops/schemas.cpp"))
    assert sorted(defined) == sorted(operator.name for operator in OPERATORS if operator.python is None)


def test_the_csrc_files_register_what_the_registry_says():
    claimed = {(key, operator.name): path for operator in OPERATORS
               for key, path in (("CPU", operator.cpu), ("CUDA", operator.cuda)) if path is not None}
    assert _registrations_in_csrc() == claimed


def test_each_cuda_file_launches_the_kernels_its_operators_name():
    # Per file, not per operator: the operators of one file (route_topk and assign_locations) share
    # functions, and which launches belong to which would take the C++ call graph.
    kernel_files = _kernel_files()
    for path, names in registry.by_file().items():
        if not path.startswith("csrc/ops/cuda/"):
            continue
        launched = {kernel_files[kernel] for kernel in re.findall(r"Kernel<cuda::kernels::(\w+)>", _read(path))}
        named: Set[str] = set()
        for name in names:
            named.update(registry.entry(name).kernels)
        assert launched == named, path
    for operator in OPERATORS:
        assert operator.cuda is not None or not operator.kernels, operator.name


@pytest.mark.parametrize("operator", OPERATORS, ids=NAMES)
def test_the_named_files_and_functions_exist(operator):
    for path in (operator.cpu, operator.cuda) + operator.kernels:
        assert path is None or os.path.isfile(os.path.join(REPO, path)), path
    for field in ("composite", "fake", "autograd", "python"):
        value = getattr(operator, field)
        if not _given(value):
            continue
        if value.startswith(registry.NAMESPACE + "::"):  # another operator whose autograd covers this one
            other = registry.entry(value.split("::")[1])
            assert field == "autograd" and _given(other.autograd), (operator.name, value)
            continue
        target = registry.resolve(value)
        assert callable(target), (operator.name, field, value)
        if field == "autograd" and inspect.isclass(target):
            assert issubclass(target, torch.autograd.Function), value


@pytest.mark.parametrize("operator", OPERATORS, ids=NAMES)
def test_the_dispatch_keys_are_the_registered_ones(operator):
    name = operator.name
    assert _has_kernel(name, "Meta"), f"{name}: no fake kernel"
    if operator.python is not None:
        # torch.library.custom_op: one Python kernel for every device, its autograd registered with it
        defined = registry.resolve(operator.python)
        assert defined._qualname == f"{registry.NAMESPACE}::{name}"
        assert _has_kernel(name, "CompositeExplicitAutograd")
        assert not _has_kernel(name, "CPU") and not _has_kernel(name, "CUDA")
        backward = registry.resolve(operator.autograd) if _given(operator.autograd) else None
        assert defined._backward_fn is backward
        return
    assert _has_kernel(name, "CPU") == (operator.cpu is not None)
    # A build without CUDA registers no CUDA kernels at all.
    assert _has_kernel(name, "CUDA") == (operator.cuda is not None and tutel.cuda.is_built())
    # The compiled operators' autograd lives in Python (an autograd.Function or a custom operator).
    assert not _has_kernel(name, "Autograd")


@pytest.mark.parametrize("operator", OPERATORS, ids=NAMES)
def test_the_fake_kernel_is_the_named_function(operator):
    named = registry.resolve(operator.fake)
    if operator.python is not None:
        assert registry.resolve(operator.python)._abstract_fn is named
        return
    kernel = torch._library.simple_registry.singleton.find(f"{registry.NAMESPACE}::{operator.name}").fake_impl.kernel
    # register_fake keeps the function inside a wrapper that checks the operator's Python stub once.
    registered = inspect.getclosurevars(kernel.func).nonlocals.get("func", kernel.func)
    assert registered is named


def test_every_overlap_names_listed_operators_or_direct_functions():
    named = {name for overlap in registry.OVERLAPS for name in overlap.names}
    assert all(name in NAMES or hasattr(direct, name) for name in named), named
    pairs = [{"grouped_linear", "grouped_rows_linear"}, {"route_topk", "route_without_grad", "route_experts"},
             {"routed_gated_experts", "decode_experts"}]
    assert [set(overlap.names) for overlap in registry.OVERLAPS] == pairs
    assert all(overlap.why.count(". ") == 0 and overlap.why.endswith(".") for overlap in registry.OVERLAPS)


def test_the_table_holds_every_operator_and_its_schema():
    table = registry.operator_table()
    for name in NAMES:
        assert f"| `{name}` |" in table and f"`{registry.schema(name)}`" in table
    assert registry.schema("route_topk") == ("route_topk(Tensor scores, int k, bool batch_prioritized) -> "
                                            "(Tensor indices, Tensor gates, Tensor locations, Tensor counts)")


def test_an_unknown_operator_is_a_key_error():
    with pytest.raises(KeyError, match="no operator 'nope'"):
        registry.entry("nope")


def test_the_operators_page_is_generated_from_the_registry():
    result = subprocess.run([sys.executable, os.path.join(REPO, "docs", "generate_operators.py"), "--check"],
                            capture_output=True, text=True, timeout=120, cwd=REPO)
    assert result.returncode == 0, result.stderr
