"""The grouped (megablocks_size > 0) layer path: tokens dispatched into the experts' real rows
only, against the float64 token-by-token reference (forward, l_aux, every gradient)."""
import pytest
import torch
import torch.nn.functional as F

from layer_harness import float64_copy, run_and_compare
from test_gates_experts import llama_reference
from tutel import moe
from tutel.experts._grouped import grouped_locations, occupied_rows
from tutel.impls.fast_dispatch import CriticalData


def make_layer(experts, k, capacity_factor, model_dim=10, hidden=12, expert_type="ffn", dtype=torch.float64,
               **kwargs):
    expert = {"type": expert_type, "num_experts_per_device": experts, "hidden_size_per_expert": hidden}
    expert.update(kwargs.pop("expert_extra", {}))
    layer = moe.moe_layer(gate_type={"type": "top", "k": k, "capacity_factor": capacity_factor},
                          model_dim=model_dim, experts=expert, **kwargs)
    return layer.to(dtype)


def record_grouped_calls(layer):
    """Wraps experts.forward_grouped; returns the list of (input shape, group_rows) it receives."""
    calls = []
    original = layer.experts.forward_grouped

    def recording(x, group_rows, ctx):
        calls.append((tuple(x.shape), list(group_rows)))
        return original(x, group_rows, ctx)

    layer.experts.forward_grouped = recording
    return calls


@pytest.mark.parametrize("block", [1, 3])
@pytest.mark.parametrize("capacity_factor", [0.0, 0.6, -0.6])
@pytest.mark.parametrize("experts,k", [(1, 1), (2, 2), (7, 3), (5, 4), (64, 2), (16, 4)])
def test_grouped_path_matches_reference(experts, k, capacity_factor, block):
    layer = make_layer(experts, k, capacity_factor)
    calls = record_grouped_calls(layer)
    x = torch.randn(3, 13, 10, dtype=torch.float64)
    capacity, kept = run_and_compare(layer, x, forward_kwargs=dict(megablocks_size=block), top_k=min(k, experts),
                                     capacity_factor=capacity_factor, alignment=block)
    assert len(calls) == 1, "the layer must take the grouped path"
    shape, rows = calls[0]
    assert rows == occupied_rows(layer.dispatch_count, capacity, block)
    assert shape == (sum(rows), 10) and sum(rows) <= experts * capacity
    if capacity_factor == 0:
        assert bool(kept.all())


@pytest.mark.parametrize("option", ["prescore", "bpr_drops", "no_bias", "gelu"])
def test_grouped_path_options(option):
    extra = {"has_fc1_bias": option != "no_bias", "has_fc2_bias": option != "no_bias"}
    activation = torch.nn.functional.gelu if option == "gelu" else torch.relu
    if option == "gelu":
        extra["activation_fn"] = activation
    is_postscore, bpr = option != "prescore", option == "bpr_drops"
    layer = make_layer(5, 2, 0.5 if bpr else 0.0, is_postscore=is_postscore, batch_prioritized_routing=bpr,
                       expert_extra=extra)
    calls = record_grouped_calls(layer)
    x = torch.randn(41, 10, dtype=torch.float64)
    capacity, kept = run_and_compare(layer, x, forward_kwargs=dict(megablocks_size=2), top_k=2,
                                     capacity_factor=0.5 if bpr else 0.0, alignment=2,
                                     activation=activation, is_postscore=is_postscore, batch_prioritized=bpr)
    assert len(calls) == 1
    if option == "bpr_drops":
        assert not bool(kept.all())


def test_grouped_llama_experts_match_reference():
    layer = make_layer(3, 2, 0.0, hidden=7, expert_type="llama_ffn")
    calls = record_grouped_calls(layer)
    run_and_compare(layer, torch.randn(25, 10, dtype=torch.float64), forward_kwargs=dict(megablocks_size=1),
                    top_k=2, capacity_factor=0.0, expert_reference=llama_reference)
    assert len(calls) == 1


class SkewedGate(torch.nn.Module):
    """Sends every token to expert 0 plus one other expert (half of all choices to expert 0)."""

    def __init__(self, model_dim, num_global_experts, k=2, **options):
        super().__init__()
        self.wg = torch.nn.Linear(model_dim, num_global_experts, bias=False)
        self.top_k, self.capacity_factor, self.gate_noise = k, 0.0, 0.0

    def forward(self, x):
        logits = self.wg(x)
        return logits + torch.nn.functional.one_hot(torch.zeros(x.shape[0], dtype=torch.long),
                                                    logits.shape[1]).to(logits.dtype) * 100


def skewed_gate_reference(gate):
    wg64 = float64_copy(gate.wg.weight)

    def logits(x64):
        first = F.one_hot(torch.zeros(x64.shape[0], dtype=torch.long), wg64.shape[0]).double()
        return x64 @ wg64.t() + 100 * first

    return logits, [(gate.wg.weight, wg64)]


def test_skewed_routing_computes_only_real_rows():
    torch.manual_seed(5)
    layer = moe.moe_layer(gate_type={"type": "custom", "module": SkewedGate, "k": 2}, model_dim=10,
                          experts={"type": "ffn", "num_experts_per_device": 6, "hidden_size_per_expert": 8}).double()
    calls = record_grouped_calls(layer)
    x = torch.randn(60, 10, dtype=torch.float64)
    run_and_compare(layer, x, forward_kwargs=dict(megablocks_size=1), top_k=2, capacity_factor=0.0,
                    gate_reference=skewed_gate_reference)
    shape, rows = calls[0]
    assert rows[0] == 60 and sum(rows) == 120  # the padded buffer would hold 6 * 60 rows
    assert shape == (120, 10)


def test_reserve_dims_and_low_precision_match_padded_path():
    layer = make_layer(3, 2, 0.0, model_dim=12)
    x = torch.randn(2, 5, 3, 4, dtype=torch.float64)
    torch.testing.assert_close(layer(x, reserve_dims=2, megablocks_size=2), layer(x, reserve_dims=2))
    layer = make_layer(4, 2, 0.0, dtype=torch.bfloat16)
    x = torch.randn(30, 10).to(torch.bfloat16)
    torch.testing.assert_close(layer(x, megablocks_size=1), layer(x), rtol=2e-2, atol=2e-2)


def test_grouped_path_empty_and_single_token_batches():
    layer = make_layer(4, 2, 0.0)
    for tokens in (0, 1):
        x = torch.randn(tokens, 10, dtype=torch.float64, requires_grad=True)
        y = layer(x, megablocks_size=4)
        (y.sum() + y.l_aux).backward()
        assert y.shape == (tokens, 10) and x.grad.shape == x.shape


def test_direct_expert_call_on_padded_buffer_computes_occupied_rows_only():
    """Experts called with ctx.megablocks_size on an [E, C, M] buffer: rows past each expert's
    load are zero, the others equal the plain computation."""
    layer = make_layer(3, 1, 0.0)
    x = torch.randn(3, 6, 10, dtype=torch.float64)
    ctx = type("Ctx", (), {"megablocks_size": 2, "local_dispatch_count": torch.tensor([1, 6, 0])})()
    y = layer.experts(x, ctx)
    plain = layer.experts(x, type("Plain", (), {})())
    torch.testing.assert_close(y[0, :2], plain[0, :2])
    torch.testing.assert_close(y[1], plain[1])
    assert torch.count_nonzero(y[0, 2:]) == 0 and torch.count_nonzero(y[2]) == 0


def test_grouped_locations_retarget_slots_and_drop():
    indices = torch.tensor([[0, 2, 0, 1, -1], [1, 0, 2, 2, 1]], dtype=torch.int32)
    locations = torch.tensor([[0, 0, 1, 0, 0], [1, 2, 1, 2, 0]], dtype=torch.int32)
    crit = CriticalData(3, list(indices), list(locations), [torch.ones(5)] * 2, 2, torch.tensor([3, 3, 3]))
    rows = [2, 2, 2]
    zeros, grouped, total = grouped_locations(crit, rows)
    assert total == 6 and torch.count_nonzero(zeros) == 0
    # expert e starts at row 2 e; location >= capacity 2 and a negative index are dropped (row 6 = total)
    expected = torch.tensor([[0, 4, 1, 2, 6], [3, 6, 5, 6, 2]], dtype=torch.int32)
    assert torch.equal(grouped, expected)
