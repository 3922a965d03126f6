"""tutel.paths' table: every path the chooser names has its routing and three stages, run calls them in
order on one Work, docs/design.md shows the table as it is, and the three entries (moe_layer, routed
experts, transformers' "tutel" experts) all reach the same run."""
import pathlib

import pytest
import torch

from tutel import moe, paths
from tutel.experts import routed as routed_module
from tutel.experts.routed import routed_experts
from tutel.impls import layer_paths
from tutel.paths import table
from tutel.rules.paths import RULES, Path

DESIGN = pathlib.Path(__file__).resolve().parents[2] / "docs" / "design.md"


def test_every_path_has_one_row_with_a_known_routing():
    assert set(table.STAGES) == set(Path) == {rule.path for rule in RULES}
    for path, row in table.STAGES.items():
        assert row.routing in (table.CRIT, table.PLANNED, table.ONE_PASS, table.GIVEN), path
        assert callable(row.experts), path
        assert all(stage is None or callable(stage) for stage in (row.prepare, row.finalize)), path
    experts_entry = {rule.path for rule in RULES if rule.entry == "experts"}
    assert {path for path, row in table.STAGES.items() if row.routing == table.GIVEN} == experts_entry


def test_run_calls_the_three_stages_in_order_on_one_work(monkeypatch):
    """In order, each with the same Work; a stage given as None is skipped."""
    calls = []
    stage = lambda name: (lambda work: calls.append((name, work)))
    monkeypatch.setitem(table.STAGES, Path.PADDED, table.PathStages(table.CRIT, stage("prepare"), stage("experts"),
                                                                     stage("finalize")))
    work = paths.Work(torch.zeros(2, 3), None)
    assert table.run(Path.PADDED, work) is work
    assert calls == [("prepare", work), ("experts", work), ("finalize", work)]
    calls.clear()
    monkeypatch.setitem(table.STAGES, Path.PADDED, table.PathStages(table.CRIT, None, stage("experts"), None))
    assert table.run(Path.PADDED, work) is work and calls == [("experts", work)]


def test_docs_show_the_table_as_it_is():
    text = DESIGN.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 300, "docs/design.md is the design: measurements go to performance.md"
    start, end = "<!-- path stages -->", "<!-- /path stages -->"
    assert text[text.index(start) + len(start):text.index(end)].strip() == table.stages_table()


@pytest.fixture
def runs(monkeypatch):
    """The paths the entries hand to tutel.paths.run (spied on where each entry holds it)."""
    taken = []
    for module in (layer_paths, routed_module):
        original = module.run

        def spy(path, work, original=original):
            taken.append(path)
            return original(path, work)
        monkeypatch.setattr(module, "run", spy)
    return taken


def test_layer_and_routed_experts_reach_run(runs):
    torch.manual_seed(0)
    layer = moe.moe_layer(gate_type={"type": "top", "k": 2}, model_dim=8,
                          experts={"type": "ffn", "count_per_node": 3, "hidden_size_per_expert": 5})
    layer(torch.randn(7, 8))
    x, ids = torch.randn(5, 8), torch.randint(0, 3, (5, 2))
    routed_experts(x, ids, torch.rand(5, 2), torch.randn(3, 10, 8), torch.randn(3, 8, 5), gate="swiglu")
    assert runs == [Path.PADDED, Path.EXPERTS_ONE_CALL]
