"""tests/python/host_calls.py counts what it should: every call (recursive ones included) of every
function defined under the package directory, nothing defined elsewhere (a sibling directory whose
name starts the same included), and the same calls that an independent counter, sys.setprofile,
sees on a real moe_layer call."""
import importlib.util
import os
import sys
import types
import uuid
from typing import Iterator, Tuple

import pytest
import torch

import host_calls
from host_calls import count_calls_under, count_tutel_calls, fake_cuda, shape_function_keys, tutel_package_dir

PACKAGE_MODULE = '''
import outside


def leaf(value):
    return value + 1


def recurse(depth):
    return 0 if depth == 0 else 1 + recurse(depth - 1)


def top():
    total = leaf(0) + leaf(1) + leaf(2)          # 3 calls of leaf
    total += recurse(4)                          # 5 calls of recurse: depths 4, 3, 2, 1, 0
    total += outside.twice(leaf)                 # 2 calls of leaf, from a function outside the package
    return total
'''

OUTSIDE_MODULE = '''
def twice(function):
    return function(10) + function(20)
'''


def _load(name: str, path: str) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def package(tmp_path, monkeypatch) -> Iterator[Tuple[str, types.ModuleType]]:
    """A package directory holding `inside.py` (PACKAGE_MODULE) and, beside it in a directory whose
    name starts with the package's, `outside.py`; returns (package dir, the inside module)."""
    inside_dir, outside_dir = tmp_path / "pkg", tmp_path / "pkg_sibling"
    inside_dir.mkdir()
    outside_dir.mkdir()
    (inside_dir / "inside.py").write_text(PACKAGE_MODULE)
    (outside_dir / "outside.py").write_text(OUTSIDE_MODULE)
    monkeypatch.syspath_prepend(str(outside_dir))
    monkeypatch.delitem(sys.modules, "outside", raising=False)
    module = _load(f"host_calls_inside_{uuid.uuid4().hex}", str(inside_dir / "inside.py"))
    yield str(inside_dir), module
    sys.modules.pop(module.__name__, None)


def test_counts_every_call_of_the_packages_functions_and_nothing_else(package):
    root, module = package
    counted = count_calls_under(root, module.top)
    assert counted.package_calls == 1 + 5 + 5  # top; leaf 3 + 2; recurse 5 (ncalls, recursion included)
    assert {(row.name, row.calls) for row in counted.by_function} == {("top", 1), ("leaf", 5), ("recurse", 5)}
    assert all(row.file == "inside.py" for row in counted.by_function)
    # every Python call: the package's and outside.twice (cProfile's own disable() is a C function)
    assert counted.python_calls == counted.package_calls + 1
    assert counted.builtin_calls >= 1


def test_the_breakdown_is_sorted_by_calls_then_by_place(package):
    root, module = package
    counted = count_calls_under(root, module.top)
    assert [row.name for row in counted.by_function] == ["leaf", "recurse", "top"]  # 5, 5 (leaf's line first), 1
    lines = counted.breakdown(2).splitlines()
    assert len(lines) == 2 and lines[0].split() == ["5", f"inside.py:{counted.by_function[0].line}(leaf)"]
    assert len(counted.breakdown(None).splitlines()) == 3


def test_the_directory_given_through_a_symbolic_link_counts_the_same(package, tmp_path):
    root, module = package
    link = tmp_path / "link_to_pkg"
    link.symlink_to(root, target_is_directory=True)
    assert count_calls_under(str(link), module.top).package_calls == 11


def test_count_tutel_calls_filters_on_the_package_directory(package, monkeypatch):
    """count_tutel_calls counts in whatever tutel_package_dir() names: here the test package, so
    none of tutel's own functions can be what it counts."""
    root, module = package
    monkeypatch.setattr(host_calls, "tutel_package_dir", lambda: root)
    assert count_tutel_calls(module.top).package_calls == 11


def test_an_exception_from_the_call_propagates(package):
    root, _ = package

    def fails():
        raise KeyError("raised inside")
    with pytest.raises(KeyError, match="raised inside"):
        count_calls_under(root, fails)


def test_tutels_capacity_rule_makes_the_calls_its_source_shows():
    """expert_capacity with a static capacity factor calls samples_per_expert and align_up once each
    (tutel/rules/capacity.py), and nothing else of tutel's."""
    from tutel.rules.capacity import expert_capacity
    counted = count_tutel_calls(expert_capacity, 1.0, 2, 16, 4)
    capacity_py = os.path.join("rules", "capacity.py")
    assert sorted((row.file, row.name, row.calls) for row in counted.by_function) == [
        (capacity_py, name, 1) for name in ("align_up", "expert_capacity", "samples_per_expert")]
    assert counted.package_calls == 3
    assert counted.package_dir == os.path.realpath(os.path.dirname(__import__("tutel").__file__))


def _setprofile_counts(root: str, fn) -> dict:
    """Calls of the functions under `root` as sys.setprofile sees them ('call' events: a function
    entered, a generator resumed), keyed by (file relative to root, first line, name)."""
    counts: dict = {}

    def hook(frame, event, arg):
        if event == "call":
            code = frame.f_code
            path = os.path.realpath(code.co_filename)
            if os.path.commonpath([path, root]) == root:
                key = (os.path.relpath(path, root), code.co_firstlineno, code.co_name)
                counts[key] = counts.get(key, 0) + 1
    sys.setprofile(hook)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return counts


@pytest.mark.parametrize("expert_type", ["ffn", "llama_ffn"])
def test_a_moe_layer_forward_counts_what_sys_setprofile_sees(expert_type):
    """An independent counter on a real call through many of tutel's functions: the same functions
    with the same calls."""
    from tutel import moe
    layer = moe.moe_layer(gate_type={"type": "top", "k": 2}, model_dim=16,
                          experts={"type": expert_type, "num_experts_per_device": 4, "hidden_size_per_expert": 8})
    layer.eval()
    x = torch.randn(3, 16)

    def forward():
        with torch.no_grad():
            layer(x)
    for _ in range(3):
        forward()
    counted = count_tutel_calls(forward)
    seen = _setprofile_counts(tutel_package_dir(), forward)
    assert counted.package_calls > 5  # a layer call goes through a number of tutel's functions
    assert {(row.file, row.line, row.name): row.calls for row in counted.by_function} == seen
    assert counted.package_calls == sum(seen.values())


def test_shape_functions_are_found_and_counted_on_fake_tensors(tmp_path):
    """A custom operator defined in a package, with a shape function: shape_function_keys names it,
    and on fake CUDA tensors its one call is in the package's count (the implementation is not run)."""
    namespace = f"host_calls_test_{uuid.uuid4().hex[:12]}"
    (tmp_path / "ops.py").write_text(f'''
import torch


@torch.library.custom_op("{namespace}::twice", mutates_args=())
def twice(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@twice.register_fake
def twice_shape(x):
    return torch.empty_like(x)
''')
    module = _load(f"host_calls_ops_{namespace}", str(tmp_path / "ops.py"))
    keys = shape_function_keys(str(tmp_path))
    shape = module.twice_shape.__code__
    assert keys == {(os.path.realpath(shape.co_filename), shape.co_firstlineno, "twice_shape")}
    with fake_cuda():
        x = torch.randn(4, 3, device="cuda")
        counted = count_calls_under(str(tmp_path), lambda: module.twice(x))
    names = {row.name: row.calls for row in counted.by_function}
    assert names.get("twice_shape") == 1 and "twice" not in names  # the real implementation never ran
    assert counted.calls_of(keys) == 1
