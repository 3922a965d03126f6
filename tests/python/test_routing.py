"""route_topk / assign_locations against the float64 reference (tests/python/reference.py)."""
import pytest
import torch

import reference
from conftest import ALL_DTYPES
from tutel import ops

SHAPES = [  # (tokens, experts, k)
    (0, 4, 1), (1, 1, 1), (1, 5, 5), (37, 7, 2), (37, 3, 3), (37, 128, 4),
    (4097, 8, 2), (4097, 64, 4), (64, 16, 16), (50, 2, 1),
]


@pytest.mark.parametrize("batch_prioritized", [False, True])
@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("tokens,experts,k", SHAPES)
def test_route_topk_matches_reference(tokens, experts, k, dtype, batch_prioritized):
    scores = torch.rand(tokens, experts).softmax(dim=1).to(dtype)
    result = ops.route_topk(scores, k, batch_prioritized=batch_prioritized)

    expected_ids = reference.topk_indices(scores, k)
    assert torch.equal(result.indices.t().long(), expected_ids)
    assert result.indices.dtype == torch.int32 and result.locations.dtype == torch.int32
    assert torch.equal(result.gates.t(), scores.gather(1, expected_ids))
    priority = scores.gather(1, expected_ids[:, :1]).squeeze(1) if batch_prioritized else None
    locations, counts = reference.gshard_locations(expected_ids, experts, priority)
    assert torch.equal(result.locations.t().long(), locations)
    assert torch.equal(result.counts.long(), counts)


def test_ties_go_to_the_lower_expert_and_nan_ranks_first():
    scores = torch.tensor([[0.25, 0.5, 0.5, 0.25], [0.1, float("nan"), 0.7, 0.7]])
    result = ops.route_topk(scores, 3)
    assert result.indices.t().tolist() == [[1, 2, 0], [1, 2, 3]]


def test_every_token_to_one_expert_gets_consecutive_slots():
    tokens, experts = 1000, 6
    scores = torch.full((tokens, experts), 0.01)
    scores[:, 4] = 0.95
    result = ops.route_topk(scores, 2)
    assert torch.equal(result.indices[0], torch.full((tokens,), 4, dtype=torch.int32))
    assert torch.equal(result.locations[0], torch.arange(tokens, dtype=torch.int32))
    # second choices (all expert 0, the lowest tied id) come after every first choice of expert 0 (none)
    assert torch.equal(result.locations[1], torch.arange(tokens, dtype=torch.int32))
    assert result.counts.sum(0).tolist() == [tokens, 0, 0, 0, tokens, 0]


def test_batch_prioritized_order_puts_confident_tokens_first():
    scores = torch.tensor([[0.6, 0.4], [0.9, 0.1], [0.7, 0.3]])
    result = ops.route_topk(scores, 1, batch_prioritized=True)
    assert result.locations[0].tolist() == [2, 0, 1]


@pytest.mark.parametrize("k", [1, 2, 3])
def test_gate_gradient_flows_to_scores(k):
    scores = torch.rand(23, 6, dtype=torch.float64).softmax(1).requires_grad_()
    torch.autograd.gradcheck(lambda s: ops.route_topk(s, k).gates, (scores,))

    weight = torch.randn(k, 23, dtype=torch.float64)
    (ops.route_topk(scores, k).gates * weight).sum().backward()
    ids = reference.topk_indices(scores.detach(), k)
    expected = torch.zeros(23, 6, dtype=torch.float64).scatter_(1, ids, weight.t())
    assert torch.equal(scores.grad, expected)


@pytest.mark.parametrize("with_priority", [False, True])
def test_assign_locations_for_given_indices(with_priority):
    tokens, experts, k = 301, 9, 3
    ids = torch.stack([torch.randperm(experts)[:k] for _ in range(tokens)])  # [T, k], distinct per token
    priority = torch.rand(tokens) if with_priority else None
    locations, counts = ops.assign_locations(ids.t().contiguous(), experts, priority)
    want_locations, want_counts = reference.gshard_locations(ids, experts, priority)
    assert torch.equal(locations.t().long(), want_locations)
    assert torch.equal(counts.long(), want_counts)
    # the list-of-k-tensors form (Tutel's indices_s) gives the same answer
    locations_from_list, _ = ops.assign_locations(list(ids.t().long()), experts, priority)
    assert torch.equal(locations_from_list, locations)


def test_large_multithreaded_assignment_is_exact():
    tokens, experts, k = 65536, 1024, 2
    scores = torch.rand(tokens, experts)
    result = ops.route_topk(scores, k)
    ids = result.indices.t().long()
    # Closed form of the GShard rule: rank within (choice, expert) plus earlier choices' totals.
    for j in range(k):
        e = ids[:, j]
        earlier = sum(torch.bincount(ids[:, i], minlength=experts) for i in range(j)) if j else 0
        order = torch.argsort(e, stable=True)
        rank = torch.empty(tokens, dtype=torch.long)
        sorted_e = e[order]
        starts = torch.searchsorted(sorted_e, sorted_e, side="left")
        rank[order] = torch.arange(tokens) - starts
        expected = rank + (earlier[e] if j else 0)
        assert torch.equal(result.locations[j].long(), expected)
