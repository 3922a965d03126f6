"""encode / decode and gather_slots / scatter_slots in the grouped layout of routed experts:
``indices=None`` (every choice names expert 0, no table of zeros) and the routing weights read
in place, of any floating dtype and any strides (such as ``w.t()`` of a [T, k] tensor).

Reference: the grouped pipeline written from its definition in float64,
    y[t] = sum over kept j of w[t, j] * scale[slot(t, j)] * x[t],
with a per-slot scale standing in for the experts between encode and decode, and its float64
autograd for the gradients of x, w and the rows.  The compiled CPU operators and the composite
ones (tutel.ops.composite) are held to it, and to each other bit for bit; ``indices=None`` gives
bit for bit what a table of zeros gives, and weights read in place what converted ones give."""
from typing import Optional

import pytest
import torch

import tutel  # noqa: F401  (loads the operators)
from conftest import ALL_DTYPES, tolerance
from tutel import ops
from tutel.ops import composite
from tutel.ops.backend import use_operators
from tutel.ops.checks import accumulation_dtype

IMPLEMENTATIONS = ["native", "composite"]
# (T, k, E, M): the experts only pick which choices are dropped (ids outside [0, E)).
CASES = [(0, 1, 3, 8), (1, 1, 1, 1), (2, 8, 64, 16), (3, 2, 2, 5), (37, 4, 6, 24), (130, 3, 9, 7)]
WEIGHT_DTYPES = [None, torch.float32, torch.float64, torch.bfloat16, torch.float16]


def grouped_plan(tokens: int, k: int, experts: int, generator: torch.Generator) -> torch.Tensor:
    """[k, T] int32 locations as tutel.experts.routed makes them: the kept choices sorted by expert
    hold slots 0 .. kept - 1, the dropped ones (ids outside [0, E)) sit at T * k."""
    ids = torch.randint(-1, experts + 1, (tokens, k), generator=generator)
    dropped = (ids < 0) | (ids >= experts)
    key = ids.masked_fill(dropped, experts).reshape(-1)
    order = torch.sort(key, stable=True).indices
    slot = torch.empty(tokens * k, dtype=torch.int64)
    slot[order] = torch.arange(tokens * k)
    slot = slot.masked_fill(dropped.reshape(-1), tokens * k)
    return slot.view(tokens, k).t().contiguous().to(torch.int32)


def reference(x: torch.Tensor, locations: torch.Tensor, w: Optional[torch.Tensor],
              scale: torch.Tensor) -> torch.Tensor:
    """float64 y [T, M] of the grouped pipeline, from its definition."""
    kept = locations.t() < scale.shape[0]  # [T, k]
    safe = torch.where(kept, locations.t().long(), 0)
    terms = scale[safe].unsqueeze(-1) * x.unsqueeze(1)  # [T, k, M]
    if w is not None:
        terms = terms * w.unsqueeze(-1)
    return torch.where(kept.unsqueeze(-1), terms, torch.zeros_like(terms)).sum(1)


def pipeline(x: torch.Tensor, indices: Optional[torch.Tensor], locations: torch.Tensor,
             gates: Optional[torch.Tensor], scale: torch.Tensor) -> torch.Tensor:
    """encode -> the per-slot scale -> decode with tutel's operators."""
    slots = locations.numel()
    rows = ops.encode(x, indices, locations, 1, slots)
    out = rows * scale.view(1, slots, 1)
    return ops.decode(out, indices, locations, gates=gates)


def strided_weights(tokens: int, k: int, dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    """[T, k] routing weights of `dtype` with a gap after each token's k (not contiguous even
    before the .t() that makes them [k, T])."""
    padded = torch.rand(tokens, k + 2, generator=generator, dtype=torch.float64) + 0.25
    return padded.to(dtype)[:, :k]


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("weights_dtype", WEIGHT_DTYPES, ids=str)
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("tokens,k,experts,model_dim", CASES)
def test_grouped_pipeline_matches_float64_reference(implementation, weights_dtype, dtype, tokens, k, experts,
                                                    model_dim):
    generator = torch.Generator().manual_seed(tokens * 13 + k * 7 + experts + model_dim)
    locations = grouped_plan(tokens, k, experts, generator)
    x = torch.randn(tokens, model_dim, generator=generator).to(dtype).requires_grad_(True)
    scale = (torch.rand(tokens * k, generator=generator) + 0.5).to(dtype).requires_grad_(True)
    w = None if weights_dtype is None else strided_weights(tokens, k, weights_dtype, generator).requires_grad_(True)
    with use_operators(implementation):
        y = pipeline(x, None, locations, None if w is None else w.t(), scale)
    assert y.dtype == dtype and y.shape == (tokens, model_dim)
    x64, scale64 = (t.detach().double().requires_grad_(True) for t in (x, scale))
    # The kernels see each weight converted to the accumulation dtype, float64 to float32 rounding.
    w64 = None if w is None else w.detach().to(accumulation_dtype(dtype)).double().requires_grad_(True)
    want = reference(x64, locations, w64, scale64)
    torch.testing.assert_close(y.double(), want, **tolerance(dtype))
    grad = torch.randn(tokens, model_dim, generator=generator, dtype=torch.float64)
    y.backward(grad.to(dtype))
    want.backward(grad)
    torch.testing.assert_close(x.grad.double(), x64.grad, **scaled(tolerance(dtype), k))
    if dtype in (torch.float32, torch.float64):  # 16-bit: the stand-in experts' product rounds too coarsely
        torch.testing.assert_close(scale.grad.double(), scale64.grad, **scaled(tolerance(dtype), model_dim))
    if w is not None:
        assert w.grad.dtype == weights_dtype and w.grad.shape == w.shape
        want_w = w64.grad.to(weights_dtype).double()  # the gradient comes back in w's dtype
        torch.testing.assert_close(w.grad.double(), want_w, **scaled(tolerance(min_precision(dtype, weights_dtype)),
                                                                       model_dim))


def min_precision(a: torch.dtype, b: torch.dtype) -> torch.dtype:
    """The coarser of two dtypes (for a tolerance)."""
    order = [torch.float64, torch.float32, torch.float16, torch.bfloat16]
    return max(a, b, key=order.index)


def scaled(tolerance_: dict, terms: int) -> dict:
    """The tolerance of a sum of `terms` rounded values."""
    return dict(rtol=tolerance_["rtol"], atol=tolerance_["atol"] * max(1, terms) ** 0.5)


def run_with_grads(x, indices, locations, w, scale, gates_of):
    """The encoded rows, the pipeline's output and the gradients of x, w and the decoded rows."""
    x, scale = (t.detach().clone().requires_grad_(True) for t in (x, scale))
    w = None if w is None else w.detach().clone().requires_grad_(True)
    slots = locations.numel()
    rows = ops.encode(x, indices, locations, 1, slots)
    out = rows * scale.view(1, slots, 1)
    out.retain_grad()
    y = ops.decode(out, indices, locations, gates=None if w is None else gates_of(w))
    y.backward(torch.ones_like(y))
    grads = [x.grad, None if w is None else w.grad, out.grad]
    return [rows, y] + grads


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("weights_dtype", WEIGHT_DTYPES, ids=str)
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_none_and_in_place_weights_give_what_zeros_and_converted_weights_give(implementation, weights_dtype,
                                                                              dtype):
    """Bit for bit: indices=None vs a [k, T] table of zeros, and [T, k] weights of any dtype read
    through .t() vs the same weights converted to a contiguous [k, T] table beforehand (today's
    calls), values and gradients."""
    generator = torch.Generator().manual_seed(5)
    tokens, k, experts, model_dim = 45, 3, 5, 24
    locations = grouped_plan(tokens, k, experts, generator)
    x = torch.randn(tokens, model_dim, generator=generator).to(dtype)
    scale = (torch.rand(tokens * k, generator=generator) + 0.5).to(dtype)
    w = None if weights_dtype is None else strided_weights(tokens, k, weights_dtype, generator)
    acc = accumulation_dtype(dtype)
    with use_operators(implementation):
        grouped = run_with_grads(x, None, locations, w, scale, lambda v: v.t())
        zeros = run_with_grads(x, torch.zeros_like(locations), locations, w, scale,
                               lambda v: v.t().to(acc).contiguous())
    for name, got, want in zip(["rows", "y", "x.grad", "w.grad", "rows.grad"], grouped, zeros):
        if want is None:
            assert got is None, name
            continue
        assert got.dtype == want.dtype, name
        assert torch.equal(got, want), name


@pytest.mark.parametrize("weights_dtype", WEIGHT_DTYPES, ids=str)
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("tokens,k,experts,model_dim", CASES)
def test_composite_operators_equal_the_compiled_ones(weights_dtype, dtype, tokens, k, experts, model_dim):
    """gather_slots / scatter_slots with indices=None and weights in place, with and without
    `other` (the dot products): rows bit for bit, dots to the accumulation dtype's rounding."""
    generator = torch.Generator().manual_seed(tokens + 31 * k + model_dim)
    locations = grouped_plan(tokens, k, experts, generator)
    slots = tokens * k
    x = torch.randn(tokens, model_dim, generator=generator).to(dtype)
    buffer = torch.randn(2, slots, model_dim, generator=generator).to(dtype)  # expert 1: never named
    weights = None if weights_dtype is None else strided_weights(tokens, k, weights_dtype, generator).t()
    for other_for_scatter, other_for_gather in ((None, None), (buffer, x)):
        native = torch.ops.tutel.scatter_slots(x, None, locations, weights, other_for_scatter, 2, slots)
        mine = composite.scatter_slots(x, None, locations, weights, other_for_scatter, 2, slots)
        assert torch.equal(native[0], mine[0])
        assert not native[0][1].any()  # expert 1's slots: nobody names them
        torch.testing.assert_close(native[1], mine[1], **tolerance(accumulation_dtype(dtype)))
        native = torch.ops.tutel.gather_slots(buffer, None, locations, weights, other_for_gather)
        mine = composite.gather_slots(buffer, None, locations, weights, other_for_gather)
        assert torch.equal(native[0], mine[0])
        torch.testing.assert_close(native[1], mine[1], **tolerance(accumulation_dtype(dtype)))


@pytest.mark.parametrize("implementation", ["compiled", "composite"])
def test_argument_checks_without_indices(implementation):
    """The same exception types from both implementations; weights of a non-floating dtype or
    of the wrong shape and malformed locations are still refused."""
    operators = torch.ops.tutel if implementation == "compiled" else composite
    x, locations = torch.randn(4, 3), torch.zeros(2, 4, dtype=torch.int32)
    with pytest.raises(TypeError):
        operators.scatter_slots(x, None, locations, torch.ones(2, 4, dtype=torch.int32), None, 1, 8)
    with pytest.raises(ValueError):
        operators.gather_slots(torch.randn(1, 8, 3), None, locations, torch.ones(4, 2), None)
    with pytest.raises(TypeError):
        operators.gather_slots(torch.randn(1, 8, 3), None, locations.long(), None, None)
    with pytest.raises(ValueError):
        operators.scatter_slots(x, None, locations.view(-1), None, None, 1, 8)
    with pytest.raises(ValueError):  # a negative location is a bad entry, as with indices
        operators.scatter_slots(x, None, locations - 1, None, None, 1, 8)


def test_fake_tensors_without_indices():
    """The fake kernels (torch.compile's shape propagation) accept indices=None."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        x, locations = torch.randn(5, 3), torch.zeros(2, 5, dtype=torch.int32)
        rows, dots = torch.ops.tutel.scatter_slots(x, None, locations, torch.ones(5, 2).t(), None, 1, 10)
        assert rows.shape == (1, 10, 3) and dots.shape == (0,)
        out, dots = torch.ops.tutel.gather_slots(rows, None, locations, None, x)
        assert out.shape == (5, 3) and dots.shape == (2, 5) and dots.dtype == torch.float32


def test_encode_with_strided_gates_and_none_indices_matches_reference():
    """encode's gates (pre-scoring) read in place too, gradients in the gates' dtype."""
    generator = torch.Generator().manual_seed(11)
    tokens, k, experts, model_dim = 29, 2, 4, 10
    locations = grouped_plan(tokens, k, experts, generator)
    x = torch.randn(tokens, model_dim, generator=generator, dtype=torch.float64).float().requires_grad_(True)
    w = strided_weights(tokens, k, torch.bfloat16, generator).requires_grad_(True)
    rows = ops.encode(x, None, locations, 1, tokens * k, gates=w.t())
    x64, w64 = x.detach().double().requires_grad_(True), w.detach().double().requires_grad_(True)
    kept = locations < tokens * k
    want = torch.zeros(tokens * k, model_dim, dtype=torch.float64)
    for j in range(k):
        t = kept[j].nonzero().squeeze(1)
        want = want.index_add(0, locations[j][t].long(), x64[t] * w64[t, j].unsqueeze(1))
    torch.testing.assert_close(rows.view(-1, model_dim).double(), want, **tolerance(torch.float32))
    grad = torch.randn(tokens * k, model_dim, generator=generator, dtype=torch.float64)
    rows.backward(grad.float().view(rows.shape))
    want.backward(grad)
    torch.testing.assert_close(x.grad.double(), x64.grad, **tolerance(torch.float32))
    assert w.grad.dtype == torch.bfloat16
    torch.testing.assert_close(w.grad.double(), w64.grad.to(torch.bfloat16).double(), **tolerance(torch.bfloat16))
