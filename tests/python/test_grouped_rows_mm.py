"""tutel.ops.grouped_mm.grouped_rows_mm against a float64 loop over the experts: values, both
gradients, both weight layouts, idle experts, rows past the last group, every dtype."""
import pytest
import torch

from tutel.ops.grouped_mm import grouped_rows_mm

TOLERANCE = {torch.float64: (1e-10, 1e-10), torch.float32: (1e-4, 1e-5),
             torch.bfloat16: (3e-2, 3e-2), torch.float16: (3e-3, 3e-3)}


def reference(rows, weight, counts, transposed, bias=None):
    """Expert e's rows times its matrix (+ its bias), one expert after another; rows of no expert
    give zeros."""
    rows, weight = rows.double(), weight.double()
    out = torch.zeros(rows.shape[0], weight.shape[2] if transposed else weight.shape[1], dtype=torch.float64)
    start = 0
    for expert, count in enumerate(counts):
        right = weight[expert] if transposed else weight[expert].t()
        out[start:start + count] = rows[start:start + count] @ right
        if bias is not None:
            out[start:start + count] += bias[expert].double()
        start += count
    return out


def _check_against_reference(dtype, transposed, counts, tail, size, with_bias):
    k_dim, o_dim = size
    gen = torch.Generator().manual_seed(sum(counts) + tail + k_dim)
    total = sum(counts) + tail
    rows = torch.randn(total, k_dim, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()
    shape = (len(counts), k_dim, o_dim) if transposed else (len(counts), o_dim, k_dim)
    weight = torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()
    bias = torch.randn(len(counts), o_dim, generator=gen, dtype=torch.float64).to(dtype).requires_grad_() \
        if with_bias else None
    offsets = torch.tensor(counts).cumsum(0).to(torch.int32)

    out = grouped_rows_mm(rows, weight, offsets, transposed, bias)
    rows64, weight64 = rows.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    bias64 = bias.detach().double().requires_grad_() if with_bias else None
    want = reference(rows64, weight64, counts, transposed, bias64)
    rtol, atol = TOLERANCE[dtype]
    assert out.dtype == dtype and out.shape == want.shape
    torch.testing.assert_close(out.double(), want, rtol=rtol, atol=atol)
    with torch.no_grad():  # the direct path, without the custom operator
        torch.testing.assert_close(grouped_rows_mm(rows, weight, offsets, transposed, bias).double(), want,
                                   rtol=rtol, atol=atol)

    grad = torch.randn(want.shape, generator=gen, dtype=torch.float64)
    inputs = (rows, weight) + ((bias,) if with_bias else ())
    inputs64 = (rows64, weight64) + ((bias64,) if with_bias else ())
    got = torch.autograd.grad(out, inputs, grad.to(dtype))
    wanted = torch.autograd.grad(want, inputs64, grad)
    for name, g, w in zip(("rows", "weight", "bias"), got, wanted):
        torch.testing.assert_close(g.double(), w, rtol=rtol * 4, atol=atol * 8, msg=lambda m: f"d {name}: {m}")
    # rows of no expert: zero output and zero gradient (nothing reads them, nothing flows back)
    assert not out[sum(counts):].any() and not got[0][sum(counts):].any()


CASES = [([3, 0, 5, 1], 0), ([0, 0, 2], 4), ([0, 0], 3), ([4], 0)]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("counts,tail", CASES)
@pytest.mark.parametrize("size", [(16, 8), (13, 7)])  # aligned for grouped_mm, and not
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_loop_reference(dtype, transposed, counts, tail, size, with_bias):
    _check_against_reference(dtype, transposed, counts, tail, size, with_bias)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("counts,tail", CASES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_grouped_mm_path_matches_loop_reference(device_grouped_mm_path, dtype, transposed, counts, tail, with_bias):
    _check_against_reference(dtype, transposed, counts, tail, (16, 8), with_bias)


@pytest.mark.parametrize("path", ["default", "grouped_mm"])
@pytest.mark.parametrize("zero_tail", [True, False])
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
def test_rows_past_the_groups_do_not_reach_the_experts_rows_or_gradients(request, path, zero_tail, transposed,
                                                                         with_bias):
    """NaN in the rows past the last group and in their upstream gradient: the experts' rows, the
    weight and bias gradients and the experts' rows' gradients equal the reference; the tail is
    zero with zero_tail (also where grouped_mm leaves it unwritten) and anything without."""
    if path == "grouped_mm":
        request.getfixturevalue("device_grouped_mm_path")
    counts, tail, (k_dim, o_dim) = [3, 0, 5], 4, (16, 8)
    kept = sum(counts)
    gen = torch.Generator().manual_seed(21)
    rows = torch.randn(kept + tail, k_dim, generator=gen)
    rows[kept:] = float("nan")
    rows.requires_grad_()
    shape = (3, k_dim, o_dim) if transposed else (3, o_dim, k_dim)
    weight = torch.randn(*shape, generator=gen).requires_grad_()
    bias = torch.randn(3, o_dim, generator=gen).requires_grad_() if with_bias else None
    offsets = torch.tensor(counts).cumsum(0).to(torch.int32)
    out = grouped_rows_mm(rows, weight, offsets, transposed, bias, zero_tail=zero_tail)

    leaves = (rows, weight) + ((bias,) if with_bias else ())
    leaves64 = [t.detach().double().requires_grad_() for t in leaves]
    want = reference(leaves64[0], leaves64[1], counts, transposed, leaves64[2] if with_bias else None)
    torch.testing.assert_close(out[:kept].double(), want[:kept], rtol=1e-4, atol=1e-5)
    if zero_tail:
        assert not out[kept:].any()
    grad = torch.randn(want.shape, generator=gen, dtype=torch.float64)
    grad[kept:] = float("nan")  # a caller that leaves the tail unspecified sends anything back for it
    got = torch.autograd.grad(out, leaves, grad.float())
    wanted = torch.autograd.grad(want[:kept], leaves64, grad[:kept])
    torch.testing.assert_close(got[0][:kept].double(), wanted[0][:kept], rtol=4e-4, atol=8e-5)
    for g, w in zip(got[1:], wanted[1:]):
        torch.testing.assert_close(g.double(), w, rtol=4e-4, atol=8e-5)


def test_operator_registration_passes_opcheck():
    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(9, 16, generator=gen, requires_grad=True)
    weight = torch.randn(3, 8, 16, generator=gen, requires_grad=True)
    offsets = torch.tensor([2, 2, 7], dtype=torch.int32)
    bias = torch.randn(3, 8, generator=gen, requires_grad=True)
    for args in ((rows, weight, offsets, False), (rows, weight, offsets, False, bias),
                 (rows, weight, offsets, False, bias, False)):
        torch.library.opcheck(torch.ops.tutel.grouped_rows_mm.default, args,
                              test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))
