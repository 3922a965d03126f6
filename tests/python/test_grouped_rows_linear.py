"""tutel::grouped_rows_linear and its backward (the compiled CPU operator and the composite one)
against a float64 loop over the experts: values and the gradients of rows, weight and bias, both
weight layouts, idle experts, all rows in one expert, many experts, rows past the last end, no
rows, row-strided rows, every dtype; bad input; and, on fake CUDA tensors, that grouped_rows_mm
takes the operator (no host read of the ends) wherever PyTorch's grouped_mm has no kernel.

The CUDA kernels themselves (kernels/grouped_rows_gemm.cu) are checked against a long double loop
by their kernels-on-cpu test (tests/cpp/kernels_on_cpu/grouped_rows_gemm_cu_test.cpp), launched as
csrc/ops/cuda/grouped_rows_linear_cuda.cpp launches them; on a CUDA device the float64 comparison
below runs them too.
"""
import pytest
import torch

from conftest import require_grouped_mm
from launch_count import OperatorCount, backward_by_hand, fake_cuda
from tutel.ops import composite
from tutel.ops.grouped_mm import grouped_rows_mm

# Sums of up to ~70 products of N(0, 1) values, rounded once to the dtype.
TOLERANCE = {torch.float64: (1e-10, 1e-10), torch.float32: (1e-5, 1e-4),
             torch.bfloat16: (1.6e-2, 2e-2), torch.float16: (2e-3, 4e-3)}
IMPLEMENTATIONS = {"compiled": torch.ops.tutel, "composite": composite}


def reference(rows, weight, ends, transposed, bias):
    """Expert e's rows times its matrix plus its bias, expert after expert, in float64; zeros for the
    rows past the last end."""
    out = torch.zeros(rows.shape[0], weight.shape[2] if transposed else weight.shape[1], dtype=torch.float64)
    start = 0
    for expert, end in enumerate(ends):
        right = weight[expert] if transposed else weight[expert].t()
        out[start:end] = rows[start:end] @ right + (bias[expert] if bias is not None else 0)
        start = end
    return out


CASES = [  # (rows, experts, K, O, ends)
    (37, 5, 19, 23, [9, 9, 26, 26, 37]),           # idle experts
    (40, 4, 13, 70, [0, 40, 40, 40]),              # all rows in one expert
    (100, 6, 24, 9, [13, 13, 53, 60, 60, 80]),     # 20 rows past the last end
    (0, 3, 5, 7, [0, 0, 0]),                       # no rows
    (1, 1, 1, 1, [1]),
    (5, 2, 3, 2, [0, 0]),                          # every row past the last end
    (150, 70, 11, 5, "random"),                    # many experts, 10 rows past the last end
]


def _ends(case, gen):
    n, experts, _, _, ends = case
    if ends != "random":
        return ends
    counts = torch.bincount(torch.randint(0, experts, (n - 10,), generator=gen), minlength=experts)
    return counts.cumsum(0).tolist()


def _operands(case, dtype, transposed, gen):
    n, experts, k_dim, o_dim, _ = case
    ends = _ends(case, gen)
    rows = torch.randn(n, k_dim + 2, generator=gen, dtype=torch.float64)[:, :k_dim]  # row-strided
    shape = (experts, k_dim, o_dim) if transposed else (experts, o_dim, k_dim)
    weight = torch.randn(*shape, generator=gen, dtype=torch.float64)
    bias = torch.randn(experts, o_dim, generator=gen, dtype=torch.float64)
    return rows, weight, bias, ends


# The compiled operator on the CPU and, where there is a CUDA device, on it (the kernels of
# kernels/grouped_rows_gemm.cu), and the composite one on the CPU.
RUNS = [pytest.param("compiled", "cpu", id="compiled"), pytest.param("composite", "cpu", id="composite"),
        pytest.param("compiled", "cuda", id="cuda",
                     marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"))]


@pytest.mark.parametrize("implementation, device", RUNS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"N{c[0]}_E{c[1]}_K{c[2]}_O{c[3]}")
def test_product_and_gradients_match_the_float64_loop(implementation, device, dtype, transposed, case):
    ops = IMPLEMENTATIONS[implementation]
    gen = torch.Generator().manual_seed(case[0] * 31 + case[1])
    rows64, weight64, bias64, ends = _operands(case, dtype, transposed, gen)
    rows, weight, bias = (t.to(dtype) for t in (rows64, weight64, bias64))
    offsets = torch.tensor(ends, dtype=torch.int32)
    rtol, atol = TOLERANCE[dtype]
    # The reference takes the values the operator is given (rounded to the dtype), in float64.
    leaves = [t.detach().double().clone().requires_grad_() for t in (rows, weight, bias)]
    want = reference(*leaves[:2], ends, transposed, leaves[2])
    on = torch.device(device)
    # row-strided again, on the device
    d_rows = torch.empty(rows.shape[0], rows.shape[1] + 2, dtype=dtype, device=on)[:, :rows.shape[1]].copy_(rows)
    d_weight, d_bias, d_offsets = weight.to(on), bias.to(on), offsets.to(on)
    for with_bias in (True, False):
        out = ops.grouped_rows_linear(d_rows, d_weight, d_bias if with_bias else None, d_offsets, transposed).cpu()
        expected = want if with_bias else reference(leaves[0].detach(), leaves[1].detach(), ends, transposed, None)
        assert out.dtype == dtype and out.shape == expected.shape
        torch.testing.assert_close(out.double(), expected.detach(), rtol=rtol, atol=atol)
        assert not out[ends[-1]:].any(), "the rows past the last end must be zero"

    grad = torch.randn(want.shape, generator=gen, dtype=torch.float64).to(dtype)
    wanted = torch.autograd.grad(want, leaves, grad.double()) if want.numel() else [torch.zeros_like(t) for t in leaves]
    got = [g.cpu() for g in ops.grouped_rows_linear_backward(grad.to(on), d_rows, d_weight, d_offsets, transposed,
                                                              [True, True, True])]
    for name, g, w in zip(("rows", "weight", "bias"), got, wanted):
        assert g.dtype == dtype and g.shape == w.shape, name
        # the weight's and bias' gradients sum over up to 100 rows
        scale = 1 if name == "rows" else 4
        torch.testing.assert_close(g.double(), w, rtol=rtol * scale, atol=atol * scale, msg=lambda m: f"d {name}: {m}")
    assert not got[0][ends[-1]:].any(), "the gradient of the rows past the last end must be zero"


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS, ids=str)
@pytest.mark.parametrize("mask", [[False, True, False], [True, False, False], [False, False, True],
                                  [False, False, False]])
def test_backward_leaves_out_what_is_not_asked(implementation, mask):
    ops = IMPLEMENTATIONS[implementation]
    gen = torch.Generator().manual_seed(5)
    rows, weight, grad = (torch.randn(*s, generator=gen, dtype=torch.float64) for s in ((6, 3), (2, 4, 3), (6, 4)))
    ends = [2, 5]
    grads = ops.grouped_rows_linear_backward(grad, rows, weight, torch.tensor(ends, dtype=torch.int32), False, mask)
    leaves = [t.clone().requires_grad_() for t in (rows, weight)] + [torch.zeros(2, 4, dtype=torch.float64,
                                                                                 requires_grad=True)]
    wanted = torch.autograd.grad(reference(*leaves[:2], ends, False, leaves[2]), leaves, grad)
    empty_shapes = [(0, 3), (0,), (0, 4)]
    for asked, g, w, empty in zip(mask, grads, wanted, empty_shapes):
        if asked:
            torch.testing.assert_close(g, w)
        else:
            assert g.shape == empty


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS, ids=str)
@pytest.mark.parametrize("ends, message", [
    ([3, 2], "non-decreasing"), ([-1, 2], "non-decreasing"), ([2, 7], r"\[0, N = 6\]")])
def test_bad_ends_raise_where_they_are_read(implementation, ends, message):
    ops = IMPLEMENTATIONS[implementation]
    rows, weight, offsets = torch.randn(6, 3), torch.randn(2, 4, 3), torch.tensor(ends, dtype=torch.int32)
    with pytest.raises(ValueError, match=message):
        ops.grouped_rows_linear(rows, weight, None, offsets, False)
    with pytest.raises(ValueError, match=message):
        ops.grouped_rows_linear_backward(torch.randn(6, 4), rows, weight, offsets, False, [True, True, True])


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS, ids=str)
def test_bad_arguments_name_what_is_allowed(implementation):
    ops = IMPLEMENTATIONS[implementation]
    rows, weight, offsets = torch.randn(6, 3), torch.randn(2, 4, 3), torch.tensor([2, 6], dtype=torch.int32)
    with pytest.raises(TypeError, match="`weight`"):
        ops.grouped_rows_linear(rows, weight.double(), None, offsets, False)
    with pytest.raises(ValueError, match="`weight`.*features of `rows`"):
        ops.grouped_rows_linear(rows, weight, None, offsets, True)
    with pytest.raises(ValueError, match="`weight` must"):
        ops.grouped_rows_linear(rows, weight[0], None, offsets, False)
    with pytest.raises(TypeError, match="`offsets`"):
        ops.grouped_rows_linear(rows, weight, None, offsets.long(), False)
    with pytest.raises(ValueError, match="`offsets` must have one end per expert"):
        ops.grouped_rows_linear(rows, weight, None, torch.tensor([6], dtype=torch.int32), False)
    with pytest.raises(ValueError, match="`bias` must have shape"):
        ops.grouped_rows_linear(rows, weight, torch.randn(2, 3), offsets, False)
    with pytest.raises(TypeError, match="`rows`"):
        ops.grouped_rows_linear(rows.int(), weight.int(), None, offsets, False)
    with pytest.raises(ValueError, match="`grad`"):
        ops.grouped_rows_linear_backward(torch.randn(6, 3), rows, weight, offsets, False, [True, True, True])


def test_grouped_rows_mm_on_cpu_takes_the_operator_with_its_gradients():
    """grouped_rows_mm's autograd on CPU: rows, weight and bias gradients through the operator,
    equal to the float64 loop's."""
    gen = torch.Generator().manual_seed(11)
    case = (29, 4, 7, 5, [3, 3, 20, 25])
    rows64, weight64, bias64, ends = _operands(case, torch.float64, False, gen)
    leaves = [t.clone().requires_grad_() for t in (rows64, weight64, bias64)]
    with OperatorCount() as count:
        out = grouped_rows_mm(leaves[0], leaves[1], torch.tensor(ends, dtype=torch.int32), False, leaves[2])
    assert "tutel.grouped_rows_linear.default" in count.operators
    grad = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    got = torch.autograd.grad(out, leaves, grad)
    ref_leaves = [t.detach().clone().requires_grad_() for t in leaves]
    want = reference(*ref_leaves[:2], ends, False, ref_leaves[2])
    torch.testing.assert_close(out, want)
    for g, w in zip(got, torch.autograd.grad(want, ref_leaves, grad)):
        torch.testing.assert_close(g, w)


# float16 and float64 have no grouped_mm kernel on CUDA; neither has a float32 or unaligned one.
@pytest.mark.parametrize("dtype, columns", [(torch.float32, 64), (torch.float16, 64), (torch.float64, 64),
                                            (torch.bfloat16, 7)])
@pytest.mark.parametrize("transposed, with_bias", [(False, True), (True, False)])
def test_cuda_path_without_grouped_mm_reads_no_end_back(dtype, columns, transposed, with_bias):
    """On fake CUDA tensors (a host read raises there) grouped_rows_mm's forward and backward take
    tutel's grouped operator: one launch forward (the bias inside), two backward."""
    with fake_cuda():
        make = dict(device="cuda", dtype=dtype, requires_grad=True)
        rows = torch.randn(40, columns, **make)
        weight = torch.randn(*((5, columns, 24) if transposed else (5, 24, columns)), **make)
        bias = torch.randn(5, 24, **make) if with_bias else None
        offsets = torch.randint(0, 40, (5,), device="cuda", dtype=torch.int32)
        with OperatorCount() as forward:
            out = grouped_rows_mm(rows, weight, offsets, transposed, bias)
        assert out.shape == (40, 24) and out.device.type == "cuda"
        assert forward.operators == ["tutel.grouped_rows_linear.default"]
        seed = torch.randn_like(out)
        with OperatorCount() as backward:
            grads = backward_by_hand(out, seed)
        leaves = [t for t in (rows, weight, bias) if t is not None]
        assert {id(t): t.shape for t in leaves} == {id(t): g.shape for t, g in grads.items()}
        assert backward.operators == ["tutel.grouped_rows_linear_backward.default"]
        assert sum(backward.launches) == 2


def test_cuda_bfloat16_keeps_grouped_mm():
    """Aligned bfloat16 operands keep PyTorch's grouped_mm (tensor cores) on an sm90 device."""
    require_grouped_mm()
    with fake_cuda():
        rows = torch.randn(40, 64, device="cuda", dtype=torch.bfloat16)
        weight = torch.randn(5, 24, 64, device="cuda", dtype=torch.bfloat16)
        offsets = torch.randint(0, 40, (5,), device="cuda", dtype=torch.int32)
        with OperatorCount() as count:
            grouped_rows_mm(rows, weight, offsets)
        assert "tutel.grouped_rows_linear.default" not in count.operators
        assert any("grouped_mm" in name for name in count.operators), count.operators
