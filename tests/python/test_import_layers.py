"""tutel's modules import only downwards, as docs/design.md's layer table says, and form no cycle."""
import textwrap

import pytest

from import_layers import cycles, extension_reaches, import_graph, layering_violations, read_layers, read_sources, units


@pytest.fixture(scope="module")
def graph():
    return import_graph(read_sources())


def test_every_import_points_to_a_lower_layer(graph):
    assert layering_violations(graph, read_layers()) == []


def test_no_module_cycle(graph):
    assert cycles(graph) == []


def test_only_ops_reaches_the_extension():
    assert extension_reaches(read_sources()) == []


def test_the_table_places_every_unit_once(graph):
    layers = read_layers()
    placed = [unit for layer in layers for unit in layer]
    assert len(placed) == len(set(placed)), "a unit appears in two layers"
    assert units(graph) | {"_C"} == set(placed)


def _toy_package(files):
    return {name: (textwrap.dedent(source), is_package) for name, (source, is_package) in files.items()}


TOY_LAYERS = textwrap.dedent("""
    <!-- layers: top to bottom -->
    | layer | units |
    |---|---|
    | top | `impls` |
    | middle | `experts`, `gates` |
    | bottom | `rules` |
    <!-- /layers -->
""")

TOY = {
    "tutel": ("", True),
    "tutel.impls": ("", True),
    "tutel.impls.layer": ("from ..experts.routed import run\nfrom ..rules.capacity import align_up\n", False),
    "tutel.experts": ("", True),
    "tutel.experts.routed": ("from ..rules.capacity import align_up\n", False),
    "tutel.gates": ("", True),
    "tutel.gates.top": ("import torch\n", False),
    "tutel.rules": ("", True),
    "tutel.rules.capacity": ("def align_up(v, a):\n    return v\n", False),
}


def test_the_checker_accepts_a_package_that_points_down():
    graph = import_graph(_toy_package(TOY))
    assert graph["tutel.impls.layer"] == {"tutel.experts.routed", "tutel.rules.capacity"}
    assert layering_violations(graph, read_layers(TOY_LAYERS)) == []
    assert cycles(graph) == []


@pytest.mark.parametrize("module, added, expected", [
    # an upward import inside a function (lazy imports count)
    ("tutel.rules.capacity", "def late():\n    from ..impls import layer\n", "a layer above `rules`"),
    # a sibling in the same layer
    ("tutel.experts.routed", "from ..gates import top\n", "the same layer as `experts`"),
    # the package itself
    ("tutel.gates.top", "import tutel\n", "imports the package"),
])
def test_the_checker_reports_an_import_that_does_not_point_down(module, added, expected):
    files = dict(TOY)
    source, is_package = files[module]
    files[module] = (source + added, is_package)
    problems = layering_violations(import_graph(_toy_package(files)), read_layers(TOY_LAYERS))
    assert len(problems) == 1 and expected in problems[0], problems


def test_the_checker_reports_a_cycle_inside_a_unit():
    files = dict(TOY)
    files["tutel.experts.helper"] = ("from . import routed\n", False)
    files["tutel.experts.routed"] = ("from . import helper\n", False)
    assert cycles(import_graph(_toy_package(files))) == [["tutel.experts.helper", "tutel.experts.routed"]]


def test_the_checker_reports_a_unit_the_table_does_not_place():
    files = dict(TOY)
    files["tutel.stray"] = ("from .rules.capacity import align_up\n", False)
    problems = layering_violations(import_graph(_toy_package(files)), read_layers(TOY_LAYERS))
    assert problems == ["tutel.stray: its unit `stray` is in no layer of docs/design.md"]


@pytest.mark.parametrize("module, added, expected", [
    ("tutel.stray", "from . import _C\n", "tutel.stray:1: imports tutel._C"),
    ("tutel.experts.routed", "from .. import _C\n", "tutel.experts.routed:2: imports tutel._C"),
    ("tutel.stray", "import tutel._C\n", "tutel.stray:1: imports tutel._C"),
    ("tutel.stray", "from ._C import with_cuda\n", "tutel.stray:1: imports from tutel._C"),
    ("tutel.stray", "import tutel\nbuilt = tutel._C.with_cuda\n", "tutel.stray:2: names tutel._C"),
    ("tutel.stray", "import torch\nops = torch.ops.tutel\n", "tutel.stray:2: names torch.ops.tutel"),
    ("tutel.stray", "import torch\ny = torch.ops.tutel.route_topk.default(x, 1, False)\n",
     "tutel.stray:2: names torch.ops.tutel"),
    ("tutel.stray", "from torch.ops import tutel\n", "tutel.stray:1: imports torch.ops.tutel"),
    ("tutel.stray", "from .ops.extension import load_extension\n", "tutel.stray:1: imports load_extension"),
    ("tutel.stray", "from .ops import extension\nextension.load_extension()\n", "tutel.stray:2: names load_extension"),
    ("tutel.stray", "import importlib\nc = importlib.import_module('tutel._C')\n",
     "tutel.stray:2: imports tutel._C by name"),
    ("tutel.stray", "import torch\n@torch.library.custom_op('tutel::stray', mutates_args=())\ndef f(x): ...\n",
     "tutel.stray:2: names the operator tutel::stray"),
])
def test_the_checker_reports_a_module_outside_ops_that_reaches_the_extension(module, added, expected):
    files = dict(TOY)
    source, is_package = files.get(module, ("", False))
    files[module] = (source + added, is_package)
    problems = extension_reaches(_toy_package(files))
    assert len(problems) == 1 and problems[0].startswith(expected), problems


def test_the_checker_lets_ops_reach_the_extension():
    files = dict(TOY)
    files["tutel.ops"] = ("from .extension import load_extension\nload_extension()\n", True)
    files["tutel.ops.backend"] = ("import torch\nfrom .. import _C\nOPS = torch.ops.tutel\n", False)
    # torch's own _C and other torch.ops namespaces are not tutel's extension
    files["tutel.gates.top"] = ("import torch\nmode = torch._C._get_dispatch_mode\nadd = torch.ops.aten.add\n", False)
    assert extension_reaches(_toy_package(files)) == []
    assert extension_reaches(_toy_package(files), allowed=["tutel.stray"]) == []
    files["tutel.stray"] = ("from . import _C\n", False)
    assert extension_reaches(_toy_package(files), allowed=["tutel.stray"]) == []
    assert len(extension_reaches(_toy_package(files))) == 1
