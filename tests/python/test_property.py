"""Property-based checks over random shapes and routings (hypothesis)."""
import torch
from hypothesis import given, settings, strategies as st

import reference
from tutel import moe, ops


@st.composite
def problems(draw):
    tokens = draw(st.integers(0, 60))
    experts = draw(st.integers(1, 12))
    k = draw(st.integers(1, experts))
    model_dim = draw(st.integers(1, 9))
    capacity_factor = draw(st.sampled_from([0.0, 0.3, 1.0, 2.5, -0.5, -2.0]))
    bpr = draw(st.booleans())
    seed = draw(st.integers(0, 2**31 - 1))
    return tokens, experts, k, model_dim, capacity_factor, bpr, seed


@settings(max_examples=150, deadline=None)
@given(problems())
def test_routing_dispatch_combine_agree_with_reference(problem):
    tokens, experts, k, model_dim, capacity_factor, bpr, seed = problem
    generator = torch.Generator().manual_seed(seed)
    scores = torch.rand(tokens, experts, generator=generator, dtype=torch.float64).softmax(1)
    x = torch.randn(tokens, model_dim, generator=generator, dtype=torch.float64)

    crit, _ = moe.top_k_routing(scores, top_k=k, capacity_factor=capacity_factor,
                                batch_prioritized_routing=bpr)
    ids = reference.topk_indices(scores, k)
    priority = scores.gather(1, ids[:, :1]).squeeze(1) if bpr else None
    locations, counts = reference.gshard_locations(ids, experts, priority)
    assert torch.equal(torch.stack(crit.locations_s, 1).long().reshape(tokens, k), locations)
    assert crit.capacity == reference.capacity(capacity_factor, k, tokens, experts, counts.sum(0).tolist())

    gates = torch.stack(crit.gates_s, 1).reshape(tokens, k)
    encoded = moe.fast_encode(x, crit)
    torch.testing.assert_close(encoded, reference.encode(x, ids, locations, experts, crit.capacity))
    decoded = moe.fast_decode(encoded, crit)
    # Round trip: each token comes back weighted by the gates of its kept choices.
    kept = (locations < crit.capacity).double()
    torch.testing.assert_close(decoded, x * (gates * kept).sum(1, keepdim=True))
    if capacity_factor == 0:
        assert bool((locations < crit.capacity).all())


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 40), st.integers(1, 30), st.integers(0, 2**31 - 1))
def test_cumsum_sub_one_matches_torch(rows, cols, seed):
    mask = torch.randint(0, 2, (rows, cols), generator=torch.Generator().manual_seed(seed))
    assert torch.equal(ops.cumsum_sub_one(mask), torch.cumsum(mask, 0) - 1)
