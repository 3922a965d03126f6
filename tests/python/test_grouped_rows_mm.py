"""tutel.ops.grouped_mm.grouped_rows_mm against a float64 loop over the experts: values, both
gradients, both weight layouts, idle experts, rows past the last group, every dtype."""
import pytest
import torch

from tutel.ops.grouped_mm import grouped_rows_mm

TOLERANCE = {torch.float64: (1e-10, 1e-10), torch.float32: (1e-4, 1e-5),
             torch.bfloat16: (3e-2, 3e-2), torch.float16: (3e-3, 3e-3)}


def reference(rows, weight, counts, transposed):
    """Expert e's rows times its matrix, one expert after another; rows of no expert give zeros."""
    rows, weight = rows.double(), weight.double()
    out = torch.zeros(rows.shape[0], weight.shape[2] if transposed else weight.shape[1], dtype=torch.float64)
    start = 0
    for expert, count in enumerate(counts):
        right = weight[expert] if transposed else weight[expert].t()
        out[start:start + count] = rows[start:start + count] @ right
        start += count
    return out


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("counts,tail", [([3, 0, 5, 1], 0), ([0, 0, 2], 4), ([0, 0], 3), ([4], 0)])
@pytest.mark.parametrize("size", [(16, 8), (13, 7)])  # aligned for grouped_mm, and not
def test_matches_loop_reference(dtype, transposed, counts, tail, size):
    k_dim, o_dim = size
    gen = torch.Generator().manual_seed(sum(counts) + tail + k_dim)
    total = sum(counts) + tail
    rows = torch.randn(total, k_dim, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()
    shape = (len(counts), k_dim, o_dim) if transposed else (len(counts), o_dim, k_dim)
    weight = torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()
    offsets = torch.tensor(counts).cumsum(0).to(torch.int32)

    out = grouped_rows_mm(rows, weight, offsets, transposed)
    rows64, weight64 = rows.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    want = reference(rows64, weight64, counts, transposed)
    rtol, atol = TOLERANCE[dtype]
    assert out.dtype == dtype and out.shape == want.shape
    torch.testing.assert_close(out.double(), want, rtol=rtol, atol=atol)

    grad = torch.randn(want.shape, generator=gen, dtype=torch.float64)
    got_rows, got_weight = torch.autograd.grad(out, (rows, weight), grad.to(dtype))
    want_rows, want_weight = torch.autograd.grad(want, (rows64, weight64), grad)
    torch.testing.assert_close(got_rows.double(), want_rows, rtol=rtol * 4, atol=atol * 8)
    torch.testing.assert_close(got_weight.double(), want_weight, rtol=rtol * 4, atol=atol * 8)
    # rows of no expert: zero output and zero gradient (nothing reads them, nothing flows back)
    assert not out[sum(counts):].any() and not got_rows[sum(counts):].any()


def test_operator_registration_passes_opcheck():
    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(9, 16, generator=gen, requires_grad=True)
    weight = torch.randn(3, 8, 16, generator=gen, requires_grad=True)
    offsets = torch.tensor([2, 2, 7], dtype=torch.int32)
    torch.library.opcheck(torch.ops.tutel.grouped_rows_mm.default, (rows, weight, offsets, False),
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))
