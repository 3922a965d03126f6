"""encode / decode (values and gradients) against the float64 reference."""
import pytest
import torch

import reference
from conftest import ALL_DTYPES, tolerance
from tutel import ops

CASES = [  # (tokens, experts, k, capacity, model_dim)
    (0, 3, 1, 4, 5), (1, 1, 1, 1, 1), (37, 5, 2, 9, 7), (37, 5, 2, 0, 8), (37, 5, 2, 1, 8),
    (37, 4, 4, 40, 3), (200, 8, 2, 30, 16), (129, 16, 3, 20, 33), (300, 64, 1, 2, 6),
]


def routed(tokens, experts, k):
    """Top-k routing of random scores: ([k, T] indices, [k, T] locations, [k, T] gates)."""
    scores = torch.rand(tokens, experts).softmax(1)
    result = ops.route_topk(scores, k)
    gates = torch.rand(k, tokens, dtype=torch.float64) + 0.1
    return result.indices, result.locations, gates


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("tokens,experts,k,capacity,model_dim", CASES)
def test_encode_decode_match_reference(tokens, experts, k, capacity, model_dim, dtype, weighted):
    indices, locations, gates = routed(tokens, experts, k)
    gates_arg = gates if weighted else None
    x = torch.randn(tokens, model_dim).to(dtype)
    y = torch.randn(experts, capacity, model_dim).to(dtype)
    # The reference works on the same (already rounded) inputs in float64; the kernel
    # rounds gates to the accumulation dtype, so the reference does too.
    gates_ref = None if gates_arg is None else gates.to(ops.checks.accumulation_dtype(dtype)).t()
    indices_tk, locations_tk = indices.t().long(), locations.t().long()

    encoded = ops.encode(x, indices, locations, experts, capacity, gates=gates_arg)
    assert encoded.dtype == dtype and encoded.shape == (experts, capacity, model_dim)
    expected = reference.encode(x, indices_tk, locations_tk, experts, capacity, gates_ref)
    torch.testing.assert_close(encoded.double(), expected, **tolerance(dtype))

    decoded = ops.decode(y, indices, locations, gates=gates_arg)
    assert decoded.dtype == dtype and decoded.shape == (tokens, model_dim)
    expected = reference.decode(y, indices_tk, locations_tk, gates_ref)
    torch.testing.assert_close(decoded.double(), expected, **tolerance(dtype))


@pytest.mark.parametrize("tokens,experts,k,capacity,model_dim", [(13, 4, 2, 3, 5), (9, 3, 3, 9, 4), (7, 2, 1, 2, 3)])
def test_gradcheck_float64(tokens, experts, k, capacity, model_dim):
    indices, locations, gates = routed(tokens, experts, k)
    gates.requires_grad_()
    x = torch.randn(tokens, model_dim, dtype=torch.float64, requires_grad=True)
    y = torch.randn(experts, capacity, model_dim, dtype=torch.float64, requires_grad=True)
    enc = lambda x_, g_: ops.encode(x_, indices, locations, experts, capacity, gates=g_)
    dec = lambda y_, g_: ops.decode(y_, indices, locations, gates=g_)
    assert torch.autograd.gradcheck(enc, (x, gates))
    assert torch.autograd.gradcheck(dec, (y, gates))
    assert torch.autograd.gradcheck(lambda x_: ops.encode(x_, indices, locations, experts, capacity), (x,))
    assert torch.autograd.gradcheck(lambda y_: ops.decode(y_, indices, locations), (y,))


@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_gradients_match_dense_reference(dtype):
    tokens, experts, k, capacity, model_dim = 61, 6, 2, 12, 10  # capacity < load: some drops
    indices, locations, gates = routed(tokens, experts, k)
    indices_tk, locations_tk = indices.t().long(), locations.t().long()
    acc = ops.checks.accumulation_dtype(dtype)
    x = torch.randn(tokens, model_dim).to(dtype).requires_grad_()
    y = torch.randn(experts, capacity, model_dim).to(dtype).requires_grad_()
    g = gates.to(acc).requires_grad_()
    up_enc = torch.randn(experts, capacity, model_dim).to(dtype)
    up_dec = torch.randn(tokens, model_dim).to(dtype)

    (ops.encode(x, indices, locations, experts, capacity, gates=g) * up_enc).sum().backward()
    (ops.decode(y, indices, locations, gates=g) * up_dec).sum().backward()

    x64 = x.detach().double().requires_grad_()
    y64 = y.detach().double().requires_grad_()
    g64 = g.detach().double().requires_grad_()
    (reference.encode_dense(x64, indices_tk, locations_tk, experts, capacity, g64.t()) * up_enc.double()).sum().backward()
    (reference.decode_dense(y64, indices_tk, locations_tk, g64.t()) * up_dec.double()).sum().backward()

    tol = tolerance(dtype)
    torch.testing.assert_close(x.grad.double(), x64.grad, **tol)
    torch.testing.assert_close(y.grad.double(), y64.grad, **tol)
    # Gate gradients are dot products over model_dim, accumulated in the accumulation type: the
    # products of two 16-bit values are exact there, so they match at that type's tolerance.
    torch.testing.assert_close(g.grad.double(), g64.grad, **tolerance(acc))


def test_dropped_tokens_decode_to_zero_and_get_zero_gradient():
    indices = torch.tensor([[0, 0, 0, 1]], dtype=torch.int32)
    locations = torch.tensor([[0, 1, 2, 0]], dtype=torch.int32)
    x = torch.randn(4, 3, requires_grad=True)
    gates = torch.ones(1, 4, requires_grad=True)
    buffer = ops.encode(x, indices, locations, 2, 2, gates=gates)  # token 2 does not fit
    out = ops.decode(buffer, indices, locations, gates=gates)
    assert torch.equal(out[2], torch.zeros(3))
    out.sum().backward()
    assert torch.equal(x.grad[2], torch.zeros(3))
    assert gates.grad[0, 2] == 0


def test_shared_slots_are_summed():
    indices = torch.tensor([[0, 0, 1]], dtype=torch.int32)
    locations = torch.tensor([[0, 0, 0]], dtype=torch.int32)
    x = torch.tensor([[1.0, 2.0], [10.0, 20.0], [5.0, 5.0]], dtype=torch.float64, requires_grad=True)
    buffer = ops.encode(x, indices, locations, 2, 1)
    assert buffer.tolist() == [[[11.0, 22.0]], [[5.0, 5.0]]]
    assert torch.autograd.gradcheck(lambda x_: ops.encode(x_, indices, locations, 2, 1), (x,))


def test_non_contiguous_inputs_equal_contiguous_ones():
    indices, locations, gates = routed(40, 5, 2)
    x = torch.randn(7, 40).t()  # [40, 7] view
    y = torch.randn(5, 7, 12).transpose(1, 2)  # [5, 12, 7] view
    g = torch.rand(40, 2).t()
    assert torch.equal(ops.encode(x, indices.t().contiguous().t(), locations, 5, 12, gates=g),
                       ops.encode(x.contiguous(), indices, locations, 5, 12, gates=g.contiguous()))
    assert torch.equal(ops.decode(y, indices, locations.t().contiguous().t(), gates=g),
                       ops.decode(y.contiguous(), indices, locations, gates=g.contiguous()))


@pytest.mark.parametrize("threads", [1, 2])
def test_thread_count_does_not_change_results(threads):
    indices, locations, gates = routed(3000, 32, 2)
    x = torch.randn(3000, 64)
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        a = ops.encode(x, indices, locations, 32, 200, gates=gates)
        b = ops.decode(a, indices, locations, gates=gates)
    finally:
        torch.set_num_threads(previous)
    torch.set_num_threads(1)
    try:
        assert torch.equal(a, ops.encode(x, indices, locations, 32, 200, gates=gates))
        assert torch.equal(b, ops.decode(a, indices, locations, gates=gates))
    finally:
        torch.set_num_threads(previous)
