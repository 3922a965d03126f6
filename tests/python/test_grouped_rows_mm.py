"""tutel.ops.grouped_mm.grouped_rows_mm against a float64 loop over the experts: values, both
gradients, both weight layouts, idle experts, rows past the last group, every dtype."""
import pytest
import torch

import tutel.ops.grouped_mm as grouped_mm_module
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


@pytest.fixture
def on_grouped_mm(monkeypatch):
    """Takes the path devices take (torch.nn.functional.grouped_mm, the bias added by row index)
    on the CPU, where grouped_mm has a kernel for these operands."""
    monkeypatch.setattr(grouped_mm_module, "_use_grouped_mm",
                        lambda a, b: a.shape[0] > 0 and grouped_mm_module.grouped_mm_supports(a, b))


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
def test_grouped_mm_path_matches_loop_reference(on_grouped_mm, dtype, transposed, counts, tail, with_bias):
    _check_against_reference(dtype, transposed, counts, tail, (16, 8), with_bias)


def test_operator_registration_passes_opcheck():
    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(9, 16, generator=gen, requires_grad=True)
    weight = torch.randn(3, 8, 16, generator=gen, requires_grad=True)
    offsets = torch.tensor([2, 2, 7], dtype=torch.int32)
    bias = torch.randn(3, 8, generator=gen, requires_grad=True)
    for args in ((rows, weight, offsets, False), (rows, weight, offsets, False, bias)):
        torch.library.opcheck(torch.ops.tutel.grouped_rows_mm.default, args,
                              test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))
