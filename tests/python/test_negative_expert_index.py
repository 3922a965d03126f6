"""Tutel's API treats a negative expert index as "not dispatched".

DeepSpeed's gates hand the dispatcher index -1 (with location 0 and gate 0) for
every token they drop, relying on Tutel's kernels to skip such choices.  The
operators underneath (tutel.ops) keep rejecting negative indices; the Tutel
layer (fast_dispatcher, fast_encode, fast_decode) maps them to dropped choices.
"""
import pytest
import torch

from tutel import moe
from tutel.impls.fast_dispatch import CriticalData


def slot_one_hot(indices, locations, num_experts, capacity):
    """float64 [k, T, E, C]: 1 where choice (j, t) writes slot (e, l); nothing for index < 0 or l >= C."""
    k, tokens = indices.shape
    table = torch.zeros(k, tokens, num_experts, capacity, dtype=torch.float64)
    for j in range(k):
        for t in range(tokens):
            e, l = int(indices[j, t]), int(locations[j, t])
            if e >= 0 and l < capacity:
                table[j, t, e, l] = 1.0
    return table


def random_table(k, tokens, num_experts, capacity, drop_share=0.3, generator=None):
    """Distinct slots for kept choices, -1 (location 0) for a share of them, some past capacity."""
    span = max(capacity + 2, -(-k * tokens // num_experts) + 1)  # locations 0..span-1, some >= capacity
    slots = torch.randperm(num_experts * span, generator=generator)[: k * tokens].reshape(k, tokens)
    indices, locations = slots // span, slots % span
    not_dispatched = torch.rand(k, tokens, generator=generator) < drop_share
    indices = torch.where(not_dispatched, torch.full_like(indices, -1), indices)
    locations = torch.where(not_dispatched, torch.zeros_like(locations), locations)
    return indices, locations


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_dispatcher_skips_negative_expert_indices(k, dtype):
    tokens, experts, capacity, model_dim = 23, 5, 9, 7
    indices, locations = random_table(k, tokens, experts, capacity)
    assert (indices < 0).any() and (locations >= capacity).any()
    gates = torch.rand(k, tokens, dtype=torch.float32, requires_grad=True)
    x = torch.randn(tokens, model_dim, dtype=dtype, requires_grad=True)

    dispatcher = moe.fast_dispatcher(experts, capacity, model_dim, dispatch_dtype=dtype)
    # int64 lists, as DeepSpeed passes them.
    dispatcher.update(list(indices.unbind(0)), list(locations.unbind(0)), list(gates.unbind(0)),
                      capacity=torch.tensor(capacity))
    encoded = dispatcher.encode(x)
    assert encoded.shape == (experts * capacity, model_dim)
    weight = torch.randn(experts, capacity, model_dim, dtype=dtype)
    decoded = dispatcher.decode((encoded.view(experts, capacity, model_dim) * weight).view(-1, model_dim))
    upstream = torch.randn(tokens, model_dim, dtype=dtype)
    (decoded * upstream).sum().backward()

    table = slot_one_hot(indices, locations, experts, capacity)
    x64 = x.detach().double().requires_grad_()
    g64 = gates.detach().double().requires_grad_()
    expected_encoded = torch.einsum("ktec,tm->ecm", table, x64)
    expected = torch.einsum("ktec,kt,ecm->tm", table, g64, expected_encoded * weight.double())
    (expected * upstream.double()).sum().backward()

    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(encoded.double(), expected_encoded.reshape(-1, model_dim).detach(), **tol)
    torch.testing.assert_close(decoded.double(), expected.detach(), **tol)
    torch.testing.assert_close(x.grad.double(), x64.grad, **tol)
    # The gates are float32 (as DeepSpeed's), so their gradient is rounded to float32.
    torch.testing.assert_close(gates.grad.double(), g64.grad, rtol=1e-6, atol=1e-6)
    assert torch.all(gates.grad[indices < 0] == 0)


def test_fast_encode_decode_skip_negative_expert_indices():
    tokens, experts, capacity, model_dim = 17, 4, 5, 3
    indices, locations = random_table(2, tokens, experts, capacity)
    indices[0, 0], indices[1, 1] = -1, -7  # any negative index means "not dispatched"
    gates = torch.rand(2, tokens, dtype=torch.float64)
    crit = CriticalData(experts, list(indices.int().unbind(0)), list(locations.int().unbind(0)),
                        list(gates.unbind(0)), capacity, torch.zeros(experts, dtype=torch.int64))
    x = torch.randn(tokens, model_dim, dtype=torch.float64)
    table = slot_one_hot(indices, locations, experts, capacity)
    for is_postscore in (True, False):
        encoded = moe.fast_encode(x, crit, is_postscore=is_postscore)
        encode_weights = torch.ones_like(gates) if is_postscore else gates
        torch.testing.assert_close(encoded, torch.einsum("ktec,kt,tm->ecm", table, encode_weights, x))
        decode_weights = gates if is_postscore else torch.ones_like(gates)
        torch.testing.assert_close(moe.fast_decode(encoded, crit, is_postscore=is_postscore),
                                   torch.einsum("ktec,kt,ecm->tm", table, decode_weights, encoded))


def test_all_choices_not_dispatched_gives_zeros():
    dispatcher = moe.fast_dispatcher(3, 2, 4, dispatch_dtype=torch.float32)
    minus_one = torch.full((6,), -1, dtype=torch.int64)
    dispatcher.update([minus_one], [torch.zeros(6, dtype=torch.int64)], [torch.rand(6)], capacity=2)
    x = torch.randn(6, 4)
    assert torch.equal(dispatcher.encode(x), torch.zeros(6, 4))
    assert torch.equal(dispatcher.decode(torch.randn(6, 4)), torch.zeros(6, 4))


def test_other_bad_tables_still_raise():
    dispatcher = moe.fast_dispatcher(3, 4, 2, dispatch_dtype=torch.float32)
    x = torch.randn(3, 2)
    dispatcher.update([torch.tensor([0, 3, 1])], [torch.tensor([0, 0, 1])], [torch.rand(3)], capacity=4)
    with pytest.raises(IndexError, match="expert index 3"):
        dispatcher.encode(x)
    dispatcher.update([torch.tensor([0, 2, 1])], [torch.tensor([0, -1, 1])], [torch.rand(3)], capacity=4)
    with pytest.raises(ValueError, match="location -1"):
        dispatcher.encode(x)
    with pytest.raises(ValueError, match="same \\[k, tokens\\] choices"):
        dispatcher.update([torch.tensor([0, 2, 1])], [torch.tensor([0, 1])], [torch.rand(3)], capacity=4)
    with pytest.raises(TypeError, match="`locations_` must hold integers"):
        dispatcher.update([torch.tensor([0, 2, 1])], [torch.tensor([0.0, 1.0, 2.0])], [torch.rand(3)])


def test_operators_keep_rejecting_negative_indices():
    from tutel import ops
    with pytest.raises(IndexError, match="expert index -1"):
        ops.encode(torch.rand(2, 3), torch.tensor([[0, -1]]), torch.tensor([[0, 0]]), 2, 2)
