"""The grouped operator's skinny products (groups of 1..32 rows, core/skinny_gemm.h) and the GEMM
path beside them (larger groups), forward and the input gradient, against float64 sums.

Sizes straddle the kernels' blocks: inner 1..33 around the 16-element pairs, outputs around the
4-output and 16-output register blocks and the 64-output tiles, groups of 0, 1, 2, 5, 31, 32 and 33
rows (the last on the GEMM side of the threshold; the others cover every remainder of the [K, O]
kernels' 4-row groups) in one call, and calls of decoding size (one or a few groups of 1-2 rows:
the [K, O] tiles are as wide as the thread count allows, a single product split across
threads), both weight layouts, with and without a bias, and weights that are views with a
strided last dim (which the skinny kernels do not take).
"""
import pytest
import torch

import tutel  # noqa: F401  (loads the operators)

# Rounding of one result in each dtype plus the float32 accumulation over `inner` terms.
UNIT_ROUNDING = {torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}
GROUPS = [2, 0, 1, 33, 31, 32, 0, 5]
# Decoding: every group at most kStreamMaxRows (2) rows; one product alone, and several.
DECODE_GROUPS = ([1], [2], [1, 0, 2, 1, 1])


def reference(x, weight, bias, group_rows, outputs_by_inner):
    """float64 y = x @ W_g^T (outputs_by_inner, weight [G, O, K]) or x @ W_g (weight [G, K, O])."""
    pieces, start = [], 0
    for g, count in enumerate(group_rows):
        w = weight[g].double()
        w = w.t() if outputs_by_inner else w
        y = x[start:start + count].double() @ w
        if bias is not None:
            y = y + bias[g].double()
        pieces.append(y)
        start += count
    return torch.cat(pieces)


def magnitude(x, weight, bias, group_rows, outputs_by_inner):
    """sum_k |x_k w_k| (+ |b|): the scale of the rounding error an accumulation can make."""
    return reference(x.abs(), weight.abs(), None if bias is None else bias.abs(), group_rows, outputs_by_inner)


def assert_within_rounding(got, x, weight, bias, group_rows, outputs_by_inner, dtype):
    expected = reference(x, weight, bias, group_rows, outputs_by_inner)
    scale = magnitude(x, weight, bias, group_rows, outputs_by_inner)
    inner = x.shape[1]
    bound = UNIT_ROUNDING[dtype] * expected.abs() + (inner + 2) * 2.0 ** -24 * scale + 1e-30
    error = (got.double() - expected).abs()
    assert torch.all(error <= bound), f"max error {error.max().item():.3e}, worst ratio {(error / bound).max():.2f}"


def random_operands(groups, inner, outputs, outputs_by_inner, with_bias, dtype, seed):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(groups), inner, generator=generator).to(dtype)
    shape = (len(groups), outputs, inner) if outputs_by_inner else (len(groups), inner, outputs)
    weight = torch.randn(shape, generator=generator).to(dtype)
    bias = torch.randn(len(groups), outputs, generator=generator).to(dtype) if with_bias else None
    return x, weight, bias


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("outputs_by_inner", [True, False])
@pytest.mark.parametrize("inner,outputs", [(1, 1), (7, 5), (16, 16), (17, 33), (33, 65), (48, 130), (100, 31), (70, 300)])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("groups", [GROUPS, *DECODE_GROUPS], ids=["mixed", "one_row", "two_rows", "decode"])
def test_forward_matches_float64(dtype, outputs_by_inner, inner, outputs, with_bias, groups):
    x, weight, bias = random_operands(groups, inner, outputs, outputs_by_inner, with_bias, dtype, inner * 100 + outputs)
    got = torch.ops.tutel.grouped_linear(x, weight, bias, groups, outputs_by_inner)
    assert got.dtype == dtype and got.shape == (sum(groups), outputs)
    assert_within_rounding(got, x, weight, bias, groups, outputs_by_inner, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("outputs_by_inner", [True, False])
@pytest.mark.parametrize("inner,outputs", [(1, 3), (15, 17), (40, 33), (64, 100)])
@pytest.mark.parametrize("groups", [GROUPS, DECODE_GROUPS[-1]], ids=["mixed", "decode"])
def test_input_gradient_matches_float64(dtype, outputs_by_inner, inner, outputs, groups):
    """d x = d y @ W_g (or @ W_g^T): the same kernels read the matrix the other way round."""
    x, weight, _ = random_operands(groups, inner, outputs, outputs_by_inner, False, dtype, inner + outputs)
    grad = torch.randn(sum(groups), outputs, generator=torch.Generator().manual_seed(7)).to(dtype)
    grad_x, grad_weight, _ = torch.ops.tutel.grouped_linear_backward(grad, x, weight, groups, outputs_by_inner,
                                                                     [True, True, False])
    # d x = grad @ W^T in the forward's terms: the forward of `grad` with the layout flipped.
    assert_within_rounding(grad_x, grad, weight, None, groups, not outputs_by_inner, dtype)
    start = 0
    for g, count in enumerate(groups):
        rows, rows_grad = x[start:start + count].double(), grad[start:start + count].double()
        expected = rows_grad.t() @ rows if outputs_by_inner else rows.t() @ rows_grad
        torch.testing.assert_close(grad_weight[g].double(), expected, rtol=UNIT_ROUNDING[dtype] * 4,
                                   atol=UNIT_ROUNDING[dtype] * 4 * (count + 1) * 4)
        start += count


@pytest.mark.parametrize("outputs_by_inner", [True, False])
def test_strided_weight_view_takes_the_gemm_path_and_agrees(outputs_by_inner):
    x, weight, bias = random_operands([3, 1, 4], 24, 20, not outputs_by_inner, True, torch.float32, 3)
    view = weight.transpose(1, 2)  # last dim strided: the skinny kernels decline it
    got = torch.ops.tutel.grouped_linear(x, view, bias, [3, 1, 4], outputs_by_inner)
    assert_within_rounding(got, x, view, bias, [3, 1, 4], outputs_by_inner, torch.float32)


def test_special_values_propagate():
    """An inf in the matrix gives inf or nan in the rows that meet it, never a finite guess."""
    x, weight, _ = random_operands([2, 3], 20, 18, True, False, torch.float32, 11)
    weight[1, 5, 7] = float("inf")
    got = torch.ops.tutel.grouped_linear(x, weight, None, [2, 3], True)
    assert not torch.isfinite(got[2:, 5]).any()
    assert torch.isfinite(got[:2]).all() and torch.isfinite(got[2:, :5]).all()


@pytest.mark.parametrize("outputs_by_inner", [True, False])
@pytest.mark.parametrize("groups", [[1, 7, 0, 20], [1, 2, 0, 1]], ids=["mixed", "decode"])
def test_every_thread_count_gives_the_same_result(outputs_by_inner, groups):
    """The outputs are split into tiles across threads (decoding: as many as there are threads);
    each output is summed by one thread in a fixed order, so the result does not depend on how
    many threads run."""
    x, weight, bias = random_operands(groups, 96, 200, outputs_by_inner, True, torch.bfloat16, 5)
    before = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            results.append(torch.ops.tutel.grouped_linear(x, weight, bias, groups, outputs_by_inner))
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(results[0], r) for r in results[1:])
    assert_within_rounding(results[0], x, weight, bias, groups, outputs_by_inner, torch.bfloat16)


@pytest.mark.parametrize("outputs_by_inner", [True, False])
@pytest.mark.parametrize("with_bias", [False, True])
def test_bfloat16_groups_around_the_tile_products(outputs_by_inner, with_bias):
    """bfloat16 groups past the skinny products' line run on AMX tiles where the CPU has them
    (core/tile_gemm.h), up to 256 rows of [O, K] matrices (from 128 with the matrix packed) and 64 of
    [K, O] (up to 16 read in place, more interleaved), larger ones on PyTorch's GEMM: groups on both
    sides of every line in one call (3, 4, 6, 7, 16, 17, 64, 65, 100, 127, 128, 256, 257 rows), odd
    inner and output counts (partial tiles and steps), forward and the input gradient (which reads
    the matrix the other way round)."""
    groups = [7, 0, 256, 17, 64, 257, 16, 6, 65, 100, 3, 128, 4, 127]
    x, weight, bias = random_operands(groups, 75, 53, outputs_by_inner, with_bias, torch.bfloat16, 13)
    got = torch.ops.tutel.grouped_linear(x, weight, bias, groups, outputs_by_inner)
    assert_within_rounding(got, x, weight, bias, groups, outputs_by_inner, torch.bfloat16)
    grad = torch.randn(sum(groups), 53, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    grad_x, _, _ = torch.ops.tutel.grouped_linear_backward(grad, x, weight, groups, outputs_by_inner,
                                                          [True, False, False])
    assert_within_rounding(grad_x, grad, weight, None, groups, not outputs_by_inner, torch.bfloat16)
