"""The grouped (megablocks_size > 0) layer path: tokens dispatched into the experts' real rows
only, against the float64 token-by-token reference (forward, l_aux, every gradient)."""
import pytest
import torch
import torch.nn.functional as F

from layer_harness import float64_copy, run_and_compare
from test_gates_experts import llama_reference
from tutel import moe
from tutel.paths.plans import grouped_locations, occupied_rows
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


# ---------------------------------------------------------------- inference (nothing differentiated)

def record_lean_calls(layer):
    """Wraps the experts' builders for the no-grad grouped path (grouped_products, and gated_weights
    where the experts have it: the one-call operator); returns the dtypes they built for."""
    calls = []
    for name in ("grouped_products", "gated_weights"):
        original = getattr(layer.experts, name, None)
        if original is None:
            continue

        def recording(ctx, dtype, original=original):
            built = original(ctx, dtype)
            if built is not None:
                calls.append(dtype)
            return built
        setattr(layer.experts, name, recording)
    return calls


def forbid(monkeypatch, name):
    """Makes `name` (the pieces' combine_without_grad or the one-call stage's gated_experts_in_one_call,
    tutel.paths) fail when called."""
    from tutel.paths import experts_one_call, experts_pieces
    grouped = experts_pieces if name == "combine_without_grad" else experts_one_call

    def refuse(*args, **kwargs):
        raise AssertionError(f"{name} ran")
    monkeypatch.setattr(grouped, name, refuse)


LEAN_EXPERTS = {
    "ffn": dict(expert_type="ffn"),
    "ffn_gelu_no_bias": dict(expert_type="ffn", expert_extra={"activation_fn": F.gelu, "has_fc1_bias": False,
                                                              "has_fc2_bias": False}),
    "ffn_one_bias": dict(expert_type="ffn", expert_extra={"has_fc1_bias": False}),
    "llama_ffn": dict(expert_type="llama_ffn"),
}


def _lean_reference_options(name, layer):
    if name == "llama_ffn":
        return dict(expert_reference=llama_reference)
    return dict(activation=F.gelu if "gelu" in name else torch.relu)


@pytest.mark.parametrize("tokens", [0, 1, 37])
@pytest.mark.parametrize("block", [1, 3])
@pytest.mark.parametrize("capacity_factor", [0.0, 0.6, -0.6])
@pytest.mark.parametrize("experts,k", [(1, 1), (7, 3), (5, 4), (64, 8)])
@pytest.mark.parametrize("name", sorted(LEAN_EXPERTS))
def test_grouped_path_without_grad_matches_reference(name, experts, k, capacity_factor, block, tokens):
    """Inference on CPU takes the grouped path without autograd (tutel.experts._grouped): the kept
    choices grouped by tutel's counting pass, padding blocks skipped; dropped tokens as the
    reference drops them."""
    torch.manual_seed(experts * 100 + k * 10 + tokens)
    layer = make_layer(experts, k, capacity_factor, hidden=11, **LEAN_EXPERTS[name])
    lean, grouped = record_lean_calls(layer), record_grouped_calls(layer)
    x = torch.randn(tokens, 10, dtype=torch.float64)
    capacity, kept = run_and_compare(layer, x, forward_kwargs=dict(megablocks_size=block), top_k=k,
                                     capacity_factor=capacity_factor, alignment=block, no_grad=True,
                                     **_lean_reference_options(name, layer))
    assert lean == [torch.float64] and not grouped, "inference must take the path without autograd"
    if capacity_factor == 0:
        assert bool(kept.all())
    elif tokens == 37 and experts > 1:
        assert not bool(kept.all()), "the case must drop tokens"


@pytest.mark.parametrize("capacity_factor", [0.0, 0.6])
@pytest.mark.parametrize("tokens", [0, 1, 37])
def test_llama_experts_without_grad_run_in_one_call(monkeypatch, capacity_factor, tokens):
    """SwiGLU llama_ffn inference takes the one-call operator (gate and up matrices separate), with
    and without dropped tokens, and equals the reference."""
    forbid(monkeypatch, "combine_without_grad")
    torch.manual_seed(tokens)
    layer = make_layer(7, 3, capacity_factor, hidden=11, **LEAN_EXPERTS["llama_ffn"])
    run_and_compare(layer, torch.randn(tokens, 10, dtype=torch.float64), forward_kwargs=dict(megablocks_size=1),
                    top_k=3, capacity_factor=capacity_factor, no_grad=True, expert_reference=llama_reference)


def test_llama_experts_with_another_activation_keep_the_pieces(monkeypatch):
    forbid(monkeypatch, "gated_experts_in_one_call")
    layer = make_layer(5, 2, 0.0, hidden=11, expert_type="llama_ffn", expert_extra={"activation_fn": F.gelu})
    run_and_compare(layer, torch.randn(13, 10, dtype=torch.float64), forward_kwargs=dict(megablocks_size=1), top_k=2,
                    capacity_factor=0.0, no_grad=True, expert_reference=lambda experts: llama_reference(experts, F.gelu))


@pytest.mark.parametrize("name", sorted(LEAN_EXPERTS))
def test_grouped_path_without_grad_in_pieces(monkeypatch, name):
    """Pieces of 7 grouped rows (each gathered from the tokens and added back) equal the reference,
    with and without dropped tokens."""
    from tutel.paths import experts_pieces, facts
    monkeypatch.setattr(experts_pieces, "PIECE_BYTES", 1)
    monkeypatch.setattr(experts_pieces, "MIN_PIECE_ROWS", 7)
    monkeypatch.setattr(facts, "MIN_PIECE_ROWS", 7)
    forbid(monkeypatch, "gated_experts_in_one_call")
    for capacity_factor in (0.0, 0.7):
        layer = make_layer(6, 3, capacity_factor, hidden=9, **LEAN_EXPERTS[name])
        lean = record_lean_calls(layer)
        run_and_compare(layer, torch.randn(29, 10, dtype=torch.float64), forward_kwargs=dict(megablocks_size=1),
                        top_k=3, capacity_factor=capacity_factor, no_grad=True, **_lean_reference_options(name, layer))
        assert lean == [torch.float64]


@pytest.mark.parametrize("name", ["ffn", "llama_ffn"])
def test_grouped_path_without_grad_low_precision(name):
    """bfloat16 (and float32) inference against the float64 reference routed with the layer's own
    logits; with 40 choices per expert on a CPU without bf16 dot products the products run in
    float32 (tutel.ops.precision), with 2 in bfloat16."""
    from tutel.ops.precision import gemm_dtype
    for dtype, tokens in ((torch.bfloat16, 80), (torch.bfloat16, 2), (torch.float32, 33)):
        torch.manual_seed(tokens)
        layer = make_layer(4, 2, 0.0, dtype=dtype, **LEAN_EXPERTS[name])
        lean = record_lean_calls(layer)
        x = torch.randn(tokens, 10).to(dtype)
        tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
        run_and_compare(layer, x, forward_kwargs=dict(megablocks_size=1), top_k=2, capacity_factor=0.0,
                        no_grad=True, use_layer_logits=True, tol=tol, **_lean_reference_options(name, layer))
        assert lean == [gemm_dtype(dtype, x.device, tokens * 2 / 4)]


def test_grouped_path_with_grad_or_prescore_keeps_autograd():
    """Training calls (and gates applied at dispatch) run the differentiable grouped path."""
    layer = make_layer(4, 2, 0.0, expert_type="llama_ffn")
    lean, grouped = record_lean_calls(layer), record_grouped_calls(layer)
    layer(torch.randn(9, 10, dtype=torch.float64), megablocks_size=1).sum().backward()
    assert not lean and len(grouped) == 1
    layer = make_layer(4, 2, 0.0, is_postscore=False)
    lean, grouped = record_lean_calls(layer), record_grouped_calls(layer)
    with torch.no_grad():
        layer(torch.randn(9, 10, dtype=torch.float64), megablocks_size=1)
    assert not lean and len(grouped) == 1


def testchoice_table_reuses_only_the_unbound_table():
    from tutel.paths.plans import choice_table
    table = torch.arange(12, dtype=torch.int32).view(3, 4).clone()  # not itself a view, as the routing's tables
    assert choice_table(list(table.unbind(0))) is table
    for choices in (list(table.unbind(0))[::-1], list(table.unbind(0))[:2], [t.clone() for t in table.unbind(0)],
                    list(table.t().contiguous().t().unbind(0))):
        expected = torch.stack(choices)
        got = choice_table(choices)
        assert torch.equal(got, expected)
    assert choice_table(table) is table


def test_llama_weights_of_a_whole_shard_are_views_without_a_narrow():
    """With the whole expert in one shard the call's weights are views of the parameters, so their
    backward adds into the gradient instead of filling a zero tensor of the parameter's size
    (what a narrow's backward does, three weight-sized passes per step)."""
    from tutel.experts.llama_ffn import LlamaFFNNetwork
    from tutel.experts.sharding import llama_weights_for_call
    experts = LlamaFFNNetwork(model_dim=6, hidden_size_per_expert=5, num_experts_per_device=3)
    for name, weight in zip(("W_fc1", "W_fc2", "W_fc3"), llama_weights_for_call(experts, experts)):
        assert weight.shape == experts.full_shapes[name]
        assert weight.data_ptr() == getattr(experts, name).data_ptr()
        chain = [type(weight.grad_fn).__name__, type(weight.grad_fn.next_functions[0][0]).__name__]
        assert chain[0].startswith("View") and chain[1] == "AccumulateGrad", chain
