"""moe_layer's static grouped path (tutel.paths.table's STATIC_GROUPED row, the CUDA path with no host
synchronisation) against the float64 token-by-token reference: output, l_aux and every gradient,
dropless and with static capacities that drop, for both built-in experts; and its decoding-size
inference variant (STATIC_DECODE), output and l_aux.  On CPU the chooser never
picks the path (its rule names CUDA), so these tests send the layer's calls there; the fake CUDA
tests (test_launch_budget.py) show the chooser picking it and what it launches."""
import pytest
import torch

import tutel.impls.call_plans as call_plans
from layer_harness import run_and_compare
from test_gates_experts import llama_reference
from test_grouped_experts import make_layer
from tutel.impls import layer_paths
from tutel.rules.paths import Path, PathChoice


def _force(monkeypatch, path: Path):
    """Sends every moe_layer call to `path`; returns a list with a True for every call that ran it."""
    taken = []
    original = layer_paths.run

    def recording(ran, work):
        taken.append(ran is path)
        return original(ran, work)

    monkeypatch.setattr(call_plans, "choose_layer_path", lambda *args: PathChoice(path, "forced by the test"))
    monkeypatch.setattr(layer_paths, "run", recording)
    return taken


@pytest.fixture
def static_path(monkeypatch):
    return _force(monkeypatch, Path.STATIC_GROUPED)


@pytest.mark.parametrize("expert_type", ["ffn", "llama_ffn"])
@pytest.mark.parametrize("capacity_factor,batch_prioritized,normalize_gate,is_postscore", [
    (0.0, False, True, True), (0.5, False, True, True), (0.5, True, True, True), (0.6, True, False, False),
    (2.0, False, False, True), (0.0, False, True, False)])
@pytest.mark.parametrize("experts,k,tokens", [(7, 3, 37), (64, 8, 21), (3, 1, 1), (1, 1, 6), (16, 2, 29),
                                             (5, 2, 0)])
def test_static_grouped_path_matches_reference(static_path, expert_type, capacity_factor, batch_prioritized,
                                                normalize_gate, is_postscore, experts, k, tokens):
    torch.manual_seed(experts + 10 * tokens + k)
    layer = make_layer(experts, k, capacity_factor, hidden=11, expert_type=expert_type,
                       batch_prioritized_routing=batch_prioritized, normalize_gate=normalize_gate,
                       is_postscore=is_postscore)
    for param in layer.parameters():  # biases start at zero: random ones, so their gradients count
        with torch.no_grad():
            param.copy_(torch.randn_like(param) * 0.5)
    reference = dict(expert_reference=llama_reference) if expert_type == "llama_ffn" else {}
    _, kept = run_and_compare(
        layer, torch.randn(tokens, 10, dtype=torch.float64), top_k=k, capacity_factor=capacity_factor,
        batch_prioritized=batch_prioritized, normalize_gate=normalize_gate, is_postscore=is_postscore,
        **({"activation": torch.relu} if expert_type == "ffn" else {}), **reference)
    assert static_path == [True]
    if capacity_factor == 0.5 and tokens == 37:
        assert not bool(kept.all()), "the case must drop choices"
    assert layer.dispatch_count.shape == (experts,) and int(layer.dispatch_count.sum()) == tokens * k


@pytest.mark.parametrize("normalize_gate", [True, False])
@pytest.mark.parametrize("experts,k,tokens", [(7, 3, 5), (64, 8, 32), (3, 1, 1), (1, 1, 6), (16, 2, 0)])
def test_static_decode_path_matches_reference(monkeypatch, normalize_gate, experts, k, tokens):
    """Dropless inference through the decode operator (on CPU routed_gated_experts' implementation,
    on CUDA the decode kernels): output and l_aux equal the float64 reference."""
    taken = _force(monkeypatch, Path.STATIC_DECODE)
    torch.manual_seed(experts + 10 * tokens + k)
    layer = make_layer(experts, k, 0.0, hidden=11, expert_type="llama_ffn", normalize_gate=normalize_gate)
    run_and_compare(layer, torch.randn(tokens, 10, dtype=torch.float64), top_k=k, capacity_factor=0.0,
                    normalize_gate=normalize_gate, no_grad=True, expert_reference=llama_reference)
    assert taken == [True]
