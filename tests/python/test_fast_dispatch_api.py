"""Tutel's routing API (tutel.moe.top_k_routing, fast_encode/decode, fast_dispatcher)."""
import logging

import pytest
import torch

import reference
from conftest import tolerance
from tutel import moe


def tutel_reference_routing(scores, k, capacity_factor, normalize_gate=True, alignment=1, bpr=False):
    """Tutel's documented top-k routing, written with dense masks in float64."""
    tokens, experts = scores.shape
    ids = reference.topk_indices(scores, k)
    gates = scores.double().gather(1, ids)
    if k > 1 and normalize_gate:
        gates = gates / torch.clamp(gates.sum(1, keepdim=True), min=torch.finfo(torch.float64).eps)
    priority = scores.gather(1, ids[:, :1]).squeeze(1) if bpr else None
    locations, counts = reference.gshard_locations(ids, experts, priority)
    loads = counts.sum(0)
    capacity = reference.capacity(capacity_factor, k, tokens, experts, loads.tolist(), alignment)
    return ids, locations, gates, capacity, loads


@pytest.mark.parametrize("bpr", [False, True])
@pytest.mark.parametrize("alignment", [1, 4, 6])
@pytest.mark.parametrize("capacity_factor", [1.0, 0.5, 0.0, -0.6, 1.25, 2.0])
@pytest.mark.parametrize("k", [1, 2, 4])
def test_top_k_routing_matches_tutel_rules(k, capacity_factor, alignment, bpr):
    tokens, experts = 97, 8
    scores = torch.randn(tokens, experts).mul(2).softmax(1)
    crit, l_aux = moe.top_k_routing(scores, top_k=k, capacity_factor=capacity_factor,
                                    alignment=alignment, batch_prioritized_routing=bpr)
    ids, locations, gates, capacity, loads = tutel_reference_routing(
        scores, k, capacity_factor, alignment=alignment, bpr=bpr)

    num_experts, indices_s, locations_s, gates_s, crit_capacity, dispatch_count = crit
    assert num_experts == experts and isinstance(crit_capacity, int)
    assert len(indices_s) == len(locations_s) == len(gates_s) == k
    assert all(t.dtype == torch.int32 and t.shape == (tokens,) for t in indices_s + locations_s)
    assert torch.equal(torch.stack(indices_s, 1).long(), ids)
    assert torch.equal(torch.stack(locations_s, 1).long(), locations)
    torch.testing.assert_close(torch.stack(gates_s, 1).double(), gates, rtol=1e-6, atol=1e-7)
    assert crit_capacity == capacity
    # Unlike the reference, counts and dynamic capacity stay right under batch-prioritized routing.
    assert dispatch_count.dtype == torch.int64 and torch.equal(dispatch_count, loads)
    assert moe.get_dispatch_count(crit) is dispatch_count
    torch.testing.assert_close(l_aux.double(), reference.gshard_loss(scores, ids[:, 0]), rtol=1e-6, atol=1e-7)


def test_dropless_capacity_fits_every_token():
    scores = torch.randn(300, 5).mul(4).softmax(1)
    crit, _ = moe.top_k_routing(scores, top_k=2, capacity_factor=0)
    assert crit.capacity == int(crit.dispatch_count.max())
    x = torch.randn(300, 4, dtype=torch.float64)
    back = moe.fast_decode(moe.fast_encode(x, crit), crit)
    gates = torch.stack(crit.gates_s, 1).double()
    torch.testing.assert_close(back, x * gates.sum(1, keepdim=True))


def test_normalize_gate_off_keeps_raw_scores_and_loss_fn_options():
    scores = torch.rand(20, 6).softmax(1)
    seen = {}

    def my_loss(s, topk_ids):
        seen["ids"] = topk_ids
        return s.sum()

    crit, l_aux = moe.top_k_routing(scores, top_k=3, normalize_gate=False, loss_fn=my_loss)
    assert torch.equal(torch.stack(crit.gates_s, 1), scores.gather(1, seen["ids"]))
    assert seen["ids"].dtype == torch.int64 and seen["ids"].shape == (20, 3)
    assert l_aux == scores.sum()
    _, no_loss = moe.top_k_routing(scores, top_k=1, loss_fn=None)
    assert no_loss is None


@pytest.mark.parametrize("is_postscore", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_fast_encode_decode(is_postscore, dtype):
    tokens, experts, model_dim = 50, 4, 6
    scores = torch.rand(tokens, experts).softmax(1)
    crit, _ = moe.top_k_routing(scores, top_k=2, capacity_factor=0.75)
    x = torch.randn(tokens, model_dim).to(dtype)
    ids = torch.stack(crit.indices_s, 1).long()
    locs = torch.stack(crit.locations_s, 1).long()
    gates = torch.stack(crit.gates_s, 1)
    encoded = moe.fast_encode(x, crit, is_postscore=is_postscore)
    assert encoded.shape == (experts, crit.capacity, model_dim)
    expected = reference.encode(x, ids, locs, experts, crit.capacity, None if is_postscore else gates)
    torch.testing.assert_close(encoded.double(), expected, **tolerance(dtype))
    decoded = moe.fast_decode(encoded, crit, is_postscore=is_postscore)
    expected = reference.decode(encoded, ids, locs, gates if is_postscore else None)
    torch.testing.assert_close(decoded.double(), expected, **tolerance(dtype))
    # [E*C, M] input is accepted too
    assert torch.equal(moe.fast_decode(encoded.reshape(-1, model_dim), crit, is_postscore), decoded)


def test_deepspeed_style_fast_dispatcher():
    """DeepSpeed's top-1 gate with use_tutel: int64 index lists, a capacity tensor, [E*C, M] decode input."""
    tokens, experts, model_dim = 64, 4, 8
    logits = torch.randn(tokens, experts, dtype=torch.float64)
    gates_full = logits.softmax(1).requires_grad_()
    indices1 = torch.argmax(gates_full, dim=1)
    mask1 = torch.nn.functional.one_hot(indices1, experts)
    locations1 = moe.fast_cumsum_sub_one(mask1)
    capacity = torch.tensor(12)  # DeepSpeed passes a tensor
    gates1_s = (gates_full * mask1).sum(dim=1)
    locations1_s = torch.sum(locations1 * mask1, dim=1)

    x = torch.randn(tokens, model_dim, dtype=torch.float64, requires_grad=True)
    dispatcher = moe.fast_dispatcher(experts, capacity, model_dim, dispatch_dtype=x.dtype)
    dispatcher.update([indices1], [locations1_s], [gates1_s], capacity=capacity)
    dispatched = dispatcher.encode(x)
    assert dispatched.shape == (experts * 12, model_dim)
    expert_out = dispatched * 3.0
    combined = dispatcher.decode(expert_out.view(experts * 12, model_dim))
    assert combined.shape == (tokens, model_dim)

    # The same computation with dense GShard einsums.
    kept = (locations1_s < 12).double()
    expected = 3.0 * x * (gates1_s * kept)[:, None]
    torch.testing.assert_close(combined, expected)
    combined.sum().backward(retain_graph=True)
    x_grad, g_grad = x.grad.clone(), gates_full.grad.clone()
    x.grad = None
    gates_full.grad = None
    expected.sum().backward()
    torch.testing.assert_close(x_grad, x.grad)
    torch.testing.assert_close(g_grad, gates_full.grad)


def test_dispatcher_keeps_dispatch_dtype_and_gating_functions():
    tokens, experts, model_dim = 10, 2, 4
    idx = torch.tensor([[0, 1] * 5], dtype=torch.int32)
    loc = torch.tensor([[0, 0, 1, 1, 2, 2, 3, 3, 4, 4]], dtype=torch.int32)
    g = torch.rand(1, tokens)
    dispatcher = moe.fast_dispatcher(experts, 5, model_dim, torch.float16)
    dispatcher.update(list(idx), list(loc), list(g), capacity=5)
    x = torch.randn(tokens, model_dim)
    out = dispatcher.encode(x)
    assert out.dtype == torch.float16 and out.shape == (10, model_dim)
    from tutel.impls.fast_dispatch import GatingDecoder, GatingEncoder
    enc = GatingEncoder.apply(dispatcher, x.double(), g[0].double())
    torch.testing.assert_close(enc.reshape(2, 5, 4)[0, 1], x[2].double() * g[0, 2].double())
    dec = GatingDecoder.apply(dispatcher, enc)
    torch.testing.assert_close(dec, x.double() * g[0].double()[:, None])


def test_compute_sorted_location():
    from tutel.impls.fast_dispatch import compute_sorted_location
    ids = torch.tensor([1, 0, 1, 1])
    mask = torch.nn.functional.one_hot(ids, 2)
    importance = torch.tensor([-0.5, -0.9, -0.7, -0.6])  # ascending order claims first: 2, 3, 0
    loc = compute_sorted_location(mask, importance)
    assert (loc * mask).sum(1).tolist() == [2, 0, 0, 1]


def test_capacity_log_line(caplog):
    scores = torch.rand(40, 4).softmax(1)
    with caplog.at_level(logging.INFO, logger="tutel"):
        crit, _ = moe.top_k_routing(scores, top_k=2, capacity_factor=1.0)
    assert f"Capacity = {crit.capacity}, real-time capacity-factor for top-2 = 1.0" in caplog.text


def test_empty_batch():
    scores = torch.rand(0, 4).softmax(1)
    for factor in (1.0, 0.0, -1.0):
        crit, l_aux = moe.top_k_routing(scores, top_k=2, capacity_factor=factor)
        assert crit.capacity == 0 and float(l_aux) == 0.0
        x = torch.randn(0, 3)
        assert moe.fast_decode(moe.fast_encode(x, crit), crit).shape == (0, 3)
