"""The composite PyTorch operators (tutel.ops.composite) give the compiled CPU operators'
results on CPU tensors: routing, slots, counts, integer cumsums and every moved or
summed data value bit for bit (signed zeros included), dot products to rounding, the
same errors for bad entries, and the same gradients through tutel.ops; plus a float64
reference for routing and encode / decode, so the pair cannot agree on a shared mistake."""
import pytest
import torch

import reference
from conftest import ALL_DTYPES, tolerance
from tutel import ops
from tutel.ops import composite
from tutel.ops.checks import accumulation_dtype
from tutel.ops.backend import operators_for, use_operators

native = torch.ops.tutel
_BITS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def assert_bits_equal(expected: torch.Tensor, got: torch.Tensor, what: str) -> None:
    """Same dtype, shape and bit patterns (any NaN matches any NaN)."""
    assert got.dtype == expected.dtype, f"{what}: dtype {got.dtype} instead of {expected.dtype}"
    assert got.shape == expected.shape, f"{what}: shape {tuple(got.shape)} instead of {tuple(expected.shape)}"
    if expected.is_floating_point():
        nan = expected.isnan()
        assert torch.equal(nan, got.isnan()), f"{what}: NaN in other places"
        expected, got = expected.masked_fill(nan, 0), got.masked_fill(nan, 0)
        expected, got = expected.view(_BITS[expected.element_size()]), got.view(_BITS[got.element_size()])
    differ = expected != got
    assert not bool(differ.any()), f"{what}: {int(differ.sum())} of {differ.numel()} values differ"


def assert_dots_close(expected: torch.Tensor, got: torch.Tensor, what: str) -> None:
    assert got.dtype == expected.dtype and got.shape == expected.shape, what
    torch.testing.assert_close(got, expected, msg=what, **tolerance(expected.dtype))


def assert_sums_close(expected: torch.Tensor, got: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> None:
    """Sums of products in another order: the dtype's tolerance, the absolute part scaled
    by `scale`, the size of the summed terms (a result that cancels to near zero keeps
    their rounding)."""
    rtol, atol = tolerance(dtype)["rtol"], tolerance(dtype)["atol"]
    torch.testing.assert_close(got, expected, rtol=rtol, atol=atol * max(1.0, scale))


def tied_scores(tokens, experts, dtype):
    """Scores with many exact ties, -0 / +0 and NaN."""
    scores = torch.randint(0, 6, (tokens, experts)).to(torch.float64) / 4 - 0.5
    scores[torch.rand(tokens, experts) < 0.1] = -0.0
    scores[torch.rand(tokens, experts) < 0.03] = float("nan")
    return scores.to(dtype)


# ---------------------------------------------------------------- routing --

ROUTING_CASES = [  # (tokens, experts, k)
    (0, 3, 1), (1, 1, 1), (37, 5, 2), (5, 5, 5), (130, 33, 1), (300, 64, 8), (97, 70, 7), (40, 600, 3),
]


@pytest.mark.parametrize("batch_prioritized", [False, True])
@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("tokens,experts,k", ROUTING_CASES)
def test_route_topk_equals_the_cpu_operator(tokens, experts, k, dtype, batch_prioritized):
    for scores in (tied_scores(tokens, experts, dtype), torch.rand(tokens, experts).softmax(1).to(dtype)):
        expected = native.route_topk(scores, k, batch_prioritized)
        got = composite.route_topk(scores, k, batch_prioritized)
        for name, e, g in zip(("indices", "gates", "locations", "counts"), expected, got):
            assert_bits_equal(e, g, name)


@pytest.mark.parametrize("k", range(1, 9))
def test_route_topk_follows_the_float64_reference(k):
    experts = 8 + 3 * k
    scores = tied_scores(61, experts, torch.float32)
    indices, gates, locations, counts = composite.route_topk(scores, k, False)
    chosen = reference.topk_indices(scores, k)
    assert torch.equal(indices.t().long(), chosen)
    expected_locations, expected_counts = reference.gshard_locations(chosen, experts)
    assert torch.equal(locations.t().long(), expected_locations)
    assert torch.equal(counts.long(), expected_counts)
    assert_bits_equal(scores.gather(1, chosen).t().contiguous(), gates, "gates")


@pytest.mark.parametrize("priority_dtype", [None] + ALL_DTYPES)
@pytest.mark.parametrize("tokens,experts,k", [(0, 4, 2), (1, 1, 1), (77, 6, 3), (3000, 40, 2), (500, 65, 8)])
def test_assign_locations_equals_the_cpu_operator(tokens, experts, k, priority_dtype):
    indices = torch.randint(0, experts, (k, tokens), dtype=torch.int32)
    priority = None if priority_dtype is None else tied_scores(1, tokens, priority_dtype)[0]
    expected = native.assign_locations(indices, experts, priority)
    got = composite.assign_locations(indices, experts, priority)
    assert_bits_equal(expected[0], got[0], "locations")
    assert_bits_equal(expected[1], got[1], "counts")


def test_assign_locations_follows_the_float64_reference_with_priorities():
    indices = torch.randint(0, 5, (3, 90), dtype=torch.int32)
    priority = torch.randint(0, 4, (90,)).to(torch.float32)  # many equal priorities
    locations, counts = composite.assign_locations(indices, 5, priority)
    expected_locations, expected_counts = reference.gshard_locations(indices.t().long(), 5, priority)
    assert torch.equal(locations.t().long(), expected_locations)
    assert torch.equal(counts.long(), expected_counts)


# ----------------------------------------------------------------- cumsum --

MASK_DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
               torch.float32, torch.float64]


@pytest.mark.parametrize("dtype", MASK_DTYPES)
@pytest.mark.parametrize("rows,cols", [(0, 5), (5, 0), (1, 1), (300, 7), (20000, 3)])
def test_cumsum_sub_one_equals_the_cpu_operator(rows, cols, dtype):
    low = 0 if dtype in (torch.bool, torch.uint8) else -3
    mask = torch.randint(low, 2, (rows, cols)).to(dtype)
    assert_bits_equal(native.cumsum_sub_one(mask), composite.cumsum_sub_one(mask), "cumsum")
    expected = torch.cumsum(mask.to(torch.float64), 0) - 1  # integer values: exact in float64
    assert torch.equal(composite.cumsum_sub_one(mask).to(torch.float64), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cumsum_sub_one_of_fractions_is_close(dtype):
    mask = torch.rand(3000, 9, dtype=dtype)
    expected = torch.cumsum(mask.to(torch.float64), 0) - 1
    torch.testing.assert_close(composite.cumsum_sub_one(mask).to(torch.float64), expected,
                               rtol=1e-12 if dtype == torch.float64 else 1e-5, atol=1e-3)


def test_cumsum_sub_one_rejects_other_dtypes():
    with pytest.raises(TypeError, match="`mask` must be bool, an integer type, float32 or float64"):
        composite.cumsum_sub_one(torch.ones(3, 2, dtype=torch.float16))
    with pytest.raises(ValueError, match="must be 2-D"):
        composite.cumsum_sub_one(torch.ones(3))


# ------------------------------------------------------ gather / scatter --

SLOT_CASES = [  # (tokens, experts, k, capacity, model_dim)
    (0, 3, 1, 4, 8), (1, 1, 1, 1, 1), (37, 5, 2, 9, 7), (37, 5, 2, 0, 8), (37, 5, 2, 1, 16),
    (129, 16, 3, 20, 33), (300, 64, 1, 2, 6), (50, 70, 8, 3, 5), (50, 3, 2, 20, 0),
]


def slot_table(tokens, experts, k, capacity, shared):
    """Top-k routing (distinct slots, some dropped), or random locations up to
    capacity + 1 (some dropped, some slots named by several choices)."""
    if shared:
        return (torch.randint(0, experts, (k, tokens), dtype=torch.int32),
                torch.randint(0, capacity + 2, (k, tokens), dtype=torch.int32))
    result = native.route_topk(torch.rand(tokens, experts), k, False)
    return result[0], result[2]


def data(*shape, dtype):
    """Random values with some -0, +0 and exact ones (the cases copies and sums treat specially)."""
    values = torch.randn(*shape)
    values[torch.rand(*shape) < 0.05] = -0.0
    values[torch.rand(*shape) < 0.05] = 0.0
    return values.to(dtype)


def slot_weights(k, tokens, dtype):
    weights = (torch.rand(k, tokens, dtype=torch.float64) + 0.1).to(accumulation_dtype(dtype))
    weights[torch.rand(k, tokens) < 0.3] = 1.0  # weight one: the row is copied, not multiplied
    return weights


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("tokens,experts,k,capacity,model_dim", SLOT_CASES)
def test_gather_and_scatter_equal_the_cpu_operators(tokens, experts, k, capacity, model_dim, dtype, weighted,
                                                     shared):
    indices, locations = slot_table(tokens, experts, k, capacity, shared)
    weights = slot_weights(k, tokens, dtype) if weighted else None
    rows, src = data(experts, capacity, model_dim, dtype=dtype), data(tokens, model_dim, dtype=dtype)
    for other_t, other_s in ((None, None), (data(tokens, model_dim, dtype=dtype),
                                            data(experts, capacity, model_dim, dtype=dtype))):
        expected = native.gather_slots(rows, indices, locations, weights, other_t)
        got = composite.gather_slots(rows, indices, locations, weights, other_t)
        assert_bits_equal(expected[0], got[0], "gather out")
        assert_dots_close(expected[1], got[1], "gather dots")
        expected = native.scatter_slots(src, indices, locations, weights, other_s, experts, capacity)
        got = composite.scatter_slots(src, indices, locations, weights, other_s, experts, capacity)
        assert_bits_equal(expected[0], got[0], "scatter out")
        assert_dots_close(expected[1], got[1], "scatter dots")


def test_shared_slots_add_in_choice_then_token_order():
    """float16 slots named several times: the order of the additions decides the result."""
    src = torch.tensor([[2048.0], [1.0], [1.0]], dtype=torch.float16)
    indices = torch.zeros(2, 3, dtype=torch.int32)
    locations = torch.tensor([[1, 0, 0], [0, 1, 1]], dtype=torch.int32)
    out, _ = composite.scatter_slots(src, indices, locations, None, None, 1, 2)
    # slot 0 gets (choice 0: tokens 1, 2) then (choice 1: token 0): 1 + 1 = 2, + 2048 = 2050 exactly;
    # slot 1 gets 2048, then 1 twice: 2049 is a tie that rounds to even 2048, both times.
    assert out.flatten().tolist() == [2050.0, 2048.0]
    assert_bits_equal(native.scatter_slots(src, indices, locations, None, None, 1, 2)[0], out, "out")


def test_gather_and_scatter_follow_the_float64_reference():
    indices, locations = slot_table(41, 6, 3, 8, shared=False)
    gates = torch.rand(3, 41, dtype=torch.float64) + 0.1
    x, y = torch.randn(41, 5, dtype=torch.float64), torch.randn(6, 8, 5, dtype=torch.float64)
    indices_tk, locations_tk = indices.t().long(), locations.t().long()
    encoded, _ = composite.scatter_slots(x, indices, locations, gates, None, 6, 8)
    torch.testing.assert_close(encoded, reference.encode(x, indices_tk, locations_tk, 6, 8, gates.t()))
    decoded, _ = composite.gather_slots(y, indices, locations, gates, None)
    torch.testing.assert_close(decoded, reference.decode(y, indices_tk, locations_tk, gates.t()))


BAD_ENTRIES = [  # (which table, value, exception, message)
    ("indices", 9, IndexError, r"expert index 9 \(choice 1, token 2\).*0 <= index < num_experts"),
    ("indices", -1, IndexError, r"expert index -1 \(choice 1, token 2\)"),
    ("locations", -3, ValueError, r"location -3 \(choice 1, token 2\).*must be >= 0"),
]


@pytest.mark.parametrize("op", ["gather_slots", "scatter_slots"])
@pytest.mark.parametrize("table,value,error,pattern", BAD_ENTRIES)
def test_bad_entries_raise_like_the_cpu_operators(op, table, value, error, pattern):
    indices = torch.tensor([[0, 1, 2], [1, 2, 0]], dtype=torch.int32)
    locations = torch.zeros(2, 3, dtype=torch.int32)
    (indices if table == "indices" else locations)[1, 2] = value
    # A later bad entry of the other kind must not be the one reported.
    indices[1, 0], locations[0, 0] = 0, 0
    args = ((torch.randn(4, 2, 5), indices, locations, None, None) if op == "gather_slots"
            else (torch.randn(3, 5), indices, locations, None, None, 4, 2))
    for implementation in (native, composite):
        with pytest.raises(error, match=f"tutel::{op}: " + pattern):
            getattr(implementation, op)(*args)


def test_the_lowest_bad_entry_is_reported():
    indices = torch.tensor([[0, 7, 0, 8], [5, 0, 6, 0]], dtype=torch.int32)
    locations = torch.tensor([[0, 0, -2, 0], [-1, 0, 0, 0]], dtype=torch.int32)  # later bad entries
    for implementation in (native, composite):
        with pytest.raises(IndexError, match=r"expert index 7 \(choice 0, token 1\)"):
            implementation.gather_slots(torch.randn(4, 2, 3), indices, locations, None, None)


def test_assign_locations_rejects_out_of_range_indices():
    indices = torch.tensor([[0, 4, 1]], dtype=torch.int32)
    for implementation in (native, composite):
        with pytest.raises(IndexError, match=r"tutel::assign_locations: expert index 4 \(choice 0, token 1\)"):
            implementation.assign_locations(indices, 4, None)


# ------------------------------------------- through tutel.ops, with autograd --

def test_use_operators_routes_tutel_ops_to_the_composite_operators(monkeypatch):
    calls = []
    original = composite.scatter_slots
    monkeypatch.setattr(composite, "scatter_slots", lambda *args: calls.append(1) or original(*args))
    x = torch.randn(4, 3)
    indices, locations = torch.zeros(1, 4, dtype=torch.int32), torch.arange(4, dtype=torch.int32)[None]
    ops.encode(x, indices, locations, 1, 4)
    assert calls == []
    with use_operators("composite"):
        ops.encode(x, indices, locations, 1, 4)
    assert calls == [1]
    assert operators_for(x.device) is native
    with pytest.raises(ValueError, match="implementation must be 'composite' or 'native'"):
        with use_operators("fast"):
            pass


def run_layer(scores, x, k, capacity, batch_prioritized):
    """Routing, encode, a stand-in expert, decode; returns the outputs and gradients."""
    routing = ops.route_topk(scores, k, batch_prioritized)
    encoded = ops.encode(x, routing.indices, routing.locations, scores.shape[1], capacity)
    decoded = ops.decode(encoded * 2 + 1, routing.indices, routing.locations, gates=routing.gates)
    decoded.float().square().sum().backward()
    return routing, encoded, decoded


@pytest.mark.parametrize("batch_prioritized", [False, True])
@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("tokens,experts,k,capacity,model_dim", [(64, 4, 2, 20, 8), (97, 70, 8, 9, 5),
                                                                 (301, 16, 1, 12, 12), (0, 3, 2, 4, 3)])
def test_gradients_through_tutel_ops_equal_the_cpu_operators(tokens, experts, k, capacity, model_dim, dtype,
                                                              batch_prioritized):
    scores = torch.randn(tokens, experts).softmax(1).to(dtype)
    x = data(tokens, model_dim, dtype=dtype)
    results = {}
    for implementation in ("native", "composite"):
        s, v = scores.clone().requires_grad_(), x.clone().requires_grad_()
        with use_operators(implementation):
            results[implementation] = run_layer(s, v, k, capacity, batch_prioritized) + (s.grad, v.grad)
    (routing, encoded, decoded, scores_grad, x_grad) = results["native"]
    (c_routing, c_encoded, c_decoded, c_scores_grad, c_x_grad) = results["composite"]
    for name, e, g in zip(routing._fields, routing, c_routing):
        assert_bits_equal(e.detach(), g.detach(), name)
    assert_bits_equal(encoded.detach(), c_encoded.detach(), "encode")
    assert_bits_equal(x_grad, c_x_grad, "x.grad (a gather)")
    # decode's output uses the gates; its score gradient is a dot product.
    assert_sums_close(decoded.detach(), c_decoded.detach(), dtype)
    assert_sums_close(scores_grad, c_scores_grad, dtype)


def test_composite_gradcheck_float64():
    indices, locations = slot_table(13, 4, 2, 3, shared=True)
    gates = (torch.rand(2, 13, dtype=torch.float64) + 0.1).requires_grad_()
    x = torch.randn(13, 5, dtype=torch.float64, requires_grad=True)
    y = torch.randn(4, 3, 5, dtype=torch.float64, requires_grad=True)
    with use_operators("composite"):
        assert torch.autograd.gradcheck(lambda x_, g_: ops.encode(x_, indices, locations, 4, 3, gates=g_), (x, gates))
        assert torch.autograd.gradcheck(lambda y_, g_: ops.decode(y_, indices, locations, gates=g_), (y, gates))


def test_cumsum_through_tutel_ops_uses_the_composite_operator():
    mask = torch.randint(0, 2, (9, 4, 3), dtype=torch.int32)
    with use_operators("composite"):
        got = ops.cumsum_sub_one(mask, dim=1)
    assert torch.equal(got, torch.cumsum(mask, 1) - 1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_composite_on_cuda_equals_the_cpu_operators(dtype):
    indices, locations = slot_table(300, 16, 3, 20, shared=True)
    weights = slot_weights(3, 300, dtype)
    rows, src = data(16, 20, 33, dtype=dtype), data(300, 33, dtype=dtype)
    cuda = [t.cuda() for t in (rows, src, indices, locations, weights)]
    assert_bits_equal(native.gather_slots(rows, indices, locations, weights, None)[0],
                      composite.gather_slots(cuda[0], *cuda[2:], None)[0].cpu(), "gather")
    assert_bits_equal(native.scatter_slots(src, indices, locations, weights, None, 16, 20)[0],
                      composite.scatter_slots(*cuda[1:], None, 16, 20)[0].cpu(), "scatter")
    scores = tied_scores(500, 70, dtype)
    for e, g in zip(native.route_topk(scores, 4, True), composite.route_topk(scores.cuda(), 4, True)):
        assert_bits_equal(e, g.cpu(), "route_topk")


@pytest.mark.parametrize("batch_prioritized", [False, True])
@pytest.mark.parametrize("capacity_factor", [1.0, 0.0, -0.5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tutel_routing_api_gives_the_same_results_on_the_composite_operators(dtype, capacity_factor,
                                                                              batch_prioritized):
    from tutel import moe

    scores = torch.randn(97, 7).softmax(1).to(dtype)
    x = data(97, 5, dtype=dtype)
    results = {}
    for implementation in ("native", "composite"):
        s, v = scores.clone().requires_grad_(), x.clone().requires_grad_()
        with use_operators(implementation):
            crit, l_aux = moe.top_k_routing(s, top_k=3, capacity_factor=capacity_factor,
                                            batch_prioritized_routing=batch_prioritized)
            for gate in crit.gates_s:
                gate.retain_grad()
            dispatched = moe.fast_encode(v, crit)
            combined = moe.fast_decode(dispatched * 2 + 1, crit)
            (combined.float().square().sum() + l_aux.float()).backward()
        results[implementation] = (crit, dispatched, combined, s.grad, v.grad,
                                   torch.stack([gate.grad for gate in crit.gates_s]))
    (crit, dispatched, combined, scores_grad, x_grad, gates_grad) = results["native"]
    (c_crit, c_dispatched, c_combined, c_scores_grad, c_x_grad, c_gates_grad) = results["composite"]
    assert crit.capacity == c_crit.capacity
    for name in ("indices_s", "locations_s", "gates_s"):
        for e, g in zip(getattr(crit, name), getattr(c_crit, name)):
            assert_bits_equal(e.detach(), g.detach(), name)
    assert_bits_equal(dispatched.detach(), c_dispatched.detach(), "fast_encode")
    assert_bits_equal(x_grad, c_x_grad, "x.grad")
    assert_sums_close(combined.detach(), c_combined.detach(), dtype)
    # The gates' gradient is a dot product; the scores' is a softmax's backward of it, which
    # can cancel, so it keeps the dot products' absolute rounding.
    assert_sums_close(gates_grad, c_gates_grad, dtype)
    assert_sums_close(scores_grad, c_scores_grad, dtype, scale=float(gates_grad.abs().max()))


BAD_ARGUMENTS = [  # (operator, which argument is replaced, by what, exception)
    ("gather_slots", 0, torch.randn(4, 2), ValueError),                              # rows not 3-D
    ("gather_slots", 0, torch.ones(4, 2, 3, dtype=torch.int32), TypeError),          # integer rows
    ("gather_slots", 1, torch.zeros(2, 3, dtype=torch.int64), TypeError),            # int64 indices
    ("gather_slots", 2, torch.zeros(2, 4, dtype=torch.int32), ValueError),           # shapes differ
    ("gather_slots", 3, torch.ones(2, 3, dtype=torch.int32), TypeError),             # integer weights
    ("gather_slots", 3, torch.ones(3, 2), ValueError),                               # weights shape
    ("gather_slots", 4, torch.ones(3, 4), ValueError),                               # other shape
    ("scatter_slots", 0, torch.randn(4, 3), ValueError),                             # 4 rows, 3 tokens
    ("scatter_slots", 4, torch.ones(4, 2, 3, dtype=torch.float64), TypeError),       # other dtype
    ("scatter_slots", 5, 0, ValueError),                                             # no experts
]


@pytest.mark.parametrize("op,position,value,error", BAD_ARGUMENTS)
def test_bad_arguments_raise_like_the_cpu_operators(op, position, value, error):
    indices, locations = torch.zeros(2, 3, dtype=torch.int32), torch.zeros(2, 3, dtype=torch.int32)
    args = ([torch.randn(4, 2, 3), indices, locations, None, None] if op == "gather_slots"
            else [torch.randn(3, 3), indices, locations, None, None, 4, 2])
    args[position] = value
    for implementation in (native, composite):
        with pytest.raises(error, match=f"tutel::{op}: "):
            getattr(implementation, op)(*args)
