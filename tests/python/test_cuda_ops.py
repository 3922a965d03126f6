"""CUDA operators give the CPU operators' results: routing, slot assignment and
cumsum exactly, gather/scatter data bit for bit (dot products to rounding), for
every dtype; bad indices are reported.  Skipped without a CUDA device."""
import pytest
import torch

import tutel
from conftest import ALL_DTYPES
from cuda_compare import assert_data_matches, assert_dots_match, assert_identical, cuda_available, to_cuda

pytestmark = pytest.mark.skipif(not cuda_available, reason="needs a CUDA device")
tutel_ops = torch.ops.tutel


def test_a_cuda_pytorch_gets_the_cuda_operators():
    assert tutel.cuda.is_built(), "PyTorch has CUDA but tutel was built without it (see setup.py's warning)"
    path, major, _ = tutel.cuda.nvrtc_info()
    assert major >= 11 and "nvrtc" in path


def tied_scores(tokens, experts, dtype, nan=True):
    """Scores with many exact ties, +0/-0, and (optionally) NaNs."""
    scores = torch.randint(0, 6, (tokens, experts)).to(torch.float64) / 4 - 0.5
    scores[torch.rand(tokens, experts) < 0.1] = -0.0
    if nan:
        scores[torch.rand(tokens, experts) < 0.03] = float("nan")
    return scores.to(dtype)


ROUTING_CASES = [  # (tokens, experts, k)
    (0, 3, 1), (1, 1, 1), (37, 5, 2), (5, 5, 5), (1000, 64, 4), (257, 600, 3), (5000, 8, 2), (130, 33, 1),
]


@pytest.mark.parametrize("batch_prioritized", [False, True])
@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("tokens,experts,k", ROUTING_CASES)
def test_route_topk_equals_cpu(tokens, experts, k, dtype, batch_prioritized):
    for scores in (tied_scores(tokens, experts, dtype), torch.rand(tokens, experts).softmax(1).to(dtype)):
        expected = tutel_ops.route_topk(scores, k, batch_prioritized)
        got = tutel_ops.route_topk(scores.cuda(), k, batch_prioritized)
        for name, cpu, gpu in zip(("indices", "gates", "locations", "counts"), expected, got):
            assert_identical(cpu, gpu, name)


@pytest.mark.parametrize("priority_dtype", [None] + ALL_DTYPES)
@pytest.mark.parametrize("tokens,experts,k", [(0, 4, 2), (1, 1, 1), (77, 6, 3), (3000, 40, 2), (500, 700, 2)])
def test_assign_locations_equals_cpu(tokens, experts, k, priority_dtype):
    indices = torch.randint(0, experts, (k, tokens), dtype=torch.int32)
    priority = None if priority_dtype is None else tied_scores(1, tokens, priority_dtype)[0]
    expected = tutel_ops.assign_locations(indices, experts, priority)
    got = tutel_ops.assign_locations(*to_cuda(indices), experts, *to_cuda(priority))
    assert_identical(expected[0], got[0], "locations")
    assert_identical(expected[1], got[1], "counts")


MASK_DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
               torch.float32, torch.float64]


@pytest.mark.parametrize("dtype", MASK_DTYPES)
@pytest.mark.parametrize("rows,cols", [(0, 5), (5, 0), (1, 1), (300, 7), (20000, 3), (130, 1000)])
def test_cumsum_sub_one_equals_cpu(rows, cols, dtype):
    mask = torch.randint(-3 if dtype not in (torch.bool, torch.uint8) else 0, 2, (rows, cols)).to(dtype)
    assert_identical(tutel_ops.cumsum_sub_one(mask), tutel_ops.cumsum_sub_one(mask.cuda()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cumsum_sub_one_of_fractions_is_close(dtype):
    mask = torch.rand(5000, 9, dtype=dtype)
    # Running sums of up to 5000 terms in another order: relative errors of the dtype's rounding
    # times a few hundred; entries near zero (sums near 1) come from the first few rows, so an
    # absolute tolerance of the same order covers them.
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(tutel_ops.cumsum_sub_one(mask.cuda()).cpu(), tutel_ops.cumsum_sub_one(mask), **tol)


def routing_table(tokens, experts, k, capacity, shared_slots=False):
    """indices / locations [k, T] int32: top-k routing, or (shared_slots) random
    locations so that several choices claim one slot and some are dropped."""
    if shared_slots:
        indices = torch.randint(0, experts, (k, tokens), dtype=torch.int32)
        locations = torch.randint(0, capacity + 2, (k, tokens), dtype=torch.int32)
        return indices, locations
    result = tutel_ops.route_topk(torch.rand(tokens, experts), k, False)
    return result[0], result[2]


SLOT_CASES = [  # (tokens, experts, k, capacity, model_dim)
    (0, 3, 1, 4, 8), (1, 1, 1, 1, 1), (37, 5, 2, 9, 7), (37, 5, 2, 0, 8), (37, 5, 2, 1, 16),
    (200, 8, 2, 30, 64), (129, 16, 3, 20, 33), (300, 64, 1, 2, 6), (64, 4, 4, 80, 2048), (50, 3, 2, 20, 0),
]


def slot_inputs(tokens, experts, k, capacity, model_dim, dtype, weighted, with_other, misaligned):
    """(src [T, M], rows [E, C, M], weights, other_for_gather, other_for_scatter); `misaligned`
    offsets the data by one element so the kernels take their element-wise path."""
    def data(*shape):
        values = torch.randn(*shape).to(dtype)
        if not misaligned:
            return values
        storage = torch.empty(values.numel() + 1, dtype=dtype)
        view = storage[1:].view(shape)
        view.copy_(values)
        return view
    weights = (torch.rand(k, tokens, dtype=torch.float64) + 0.1).to(
        torch.float64 if dtype == torch.float64 else torch.float32) if weighted else None
    return (data(tokens, model_dim), data(experts, capacity, model_dim), weights,
            data(tokens, model_dim) if with_other else None,
            data(experts, capacity, model_dim) if with_other else None)


def gpu_copy(t):
    """A CUDA copy that keeps a misaligned storage offset."""
    if t is None:
        return None
    if t.storage_offset() == 0:
        return t.cuda()
    storage = torch.empty(t.numel() + t.storage_offset(), dtype=t.dtype, device="cuda")
    view = storage[t.storage_offset():].view(t.shape)
    view.copy_(t)
    return view


@pytest.mark.parametrize("misaligned", [False, True])
@pytest.mark.parametrize("with_other", [False, True])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("tokens,experts,k,capacity,model_dim", SLOT_CASES)
def test_gather_and_scatter_equal_cpu(tokens, experts, k, capacity, model_dim, dtype, weighted, with_other,
                                      misaligned):
    indices, locations = routing_table(tokens, experts, k, capacity)
    src, rows, weights, other_t, other_s = slot_inputs(tokens, experts, k, capacity, model_dim, dtype,
                                                       weighted, with_other, misaligned)
    g_indices, g_locations, g_weights = to_cuda(indices, locations, weights)

    out, dots = tutel_ops.gather_slots(rows, indices, locations, weights, other_t)
    g_out, g_dots = tutel_ops.gather_slots(gpu_copy(rows), g_indices, g_locations, g_weights, gpu_copy(other_t))
    assert_data_matches(out, g_out, "gather out")
    assert g_dots.shape == dots.shape
    if with_other:
        assert_dots_match(dots, g_dots, "gather dots")

    out, dots = tutel_ops.scatter_slots(src, indices, locations, weights, other_s, experts, capacity)
    g_out, g_dots = tutel_ops.scatter_slots(gpu_copy(src), g_indices, g_locations, g_weights, gpu_copy(other_s),
                                            experts, capacity)
    assert_data_matches(out, g_out, "scatter out")
    assert g_dots.shape == dots.shape
    if with_other:
        assert_dots_match(dots, g_dots, "scatter dots")
    tutel.cuda.check_errors()  # nothing was reported


@pytest.mark.parametrize("with_other", [False, True])
@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("tokens,experts,k,capacity,model_dim", [(40, 3, 2, 3, 8), (3000, 4, 3, 5, 17)])
def test_shared_slots_are_summed_like_the_cpu(tokens, experts, k, capacity, model_dim, dtype, with_other):
    indices, locations = routing_table(tokens, experts, k, capacity, shared_slots=True)
    src, _, weights, _, other = slot_inputs(tokens, experts, k, capacity, model_dim, dtype, True, with_other, False)
    out, dots = tutel_ops.scatter_slots(src, indices, locations, weights, other, experts, capacity)
    g_out, g_dots = tutel_ops.scatter_slots(*to_cuda(src, indices, locations, weights, other), experts, capacity)
    assert_data_matches(out, g_out, "scatter out")
    if with_other:
        assert_dots_match(dots, g_dots, "scatter dots")
    # Run to run, the GPU sums in the same order.
    again, _ = tutel_ops.scatter_slots(*to_cuda(src, indices, locations, weights, other), experts, capacity)
    assert_identical(g_out.cpu(), again)


def test_views_and_empty_inputs():
    indices, locations = routing_table(40, 5, 2, 12)
    x = torch.randn(7, 40).t()  # non-contiguous view
    out = tutel_ops.scatter_slots(x.cuda(), indices.t().contiguous().t().cuda(), locations.cuda(),
                                  None, None, 5, 12)[0]
    assert_identical(tutel_ops.scatter_slots(x, indices, locations, None, None, 5, 12)[0], out)
    empty = torch.empty(2, 0, dtype=torch.int32, device="cuda")
    assert tutel_ops.gather_slots(torch.randn(5, 12, 3, device="cuda"), empty, empty, None, None)[0].shape == (0, 3)


# ---------------------------------------------------------------- errors --

def bad_table(value, where):
    indices = torch.tensor([[0, 1, 2], [1, 2, 0]], dtype=torch.int32, device="cuda")
    locations = torch.zeros(2, 3, dtype=torch.int32, device="cuda")
    (indices if where == "indices" else locations)[where_entry] = value
    return indices, locations


where_entry = (1, 2)  # choice 1, token 2


@pytest.mark.parametrize("op", ["gather", "scatter"])
def test_bad_entries_are_reported_and_dropped(op):
    rows = torch.randn(4, 2, 5, device="cuda")
    src = torch.randn(3, 5, device="cuda")

    def run(indices, locations):
        if op == "gather":
            return tutel_ops.gather_slots(rows, indices, locations, None, None)[0]
        return tutel_ops.scatter_slots(src, indices, locations, None, None, 4, 2)[0]

    for table_part, value, error, pattern in (
            ("indices", 9, IndexError, "expert index 9 \\(choice 1, token 2\\).*0 <= index < num_experts"),
            ("indices", -1, IndexError, "expert index -1 \\(choice 1, token 2\\)"),
            ("locations", -3, ValueError, "location -3 \\(choice 1, token 2\\).*must be >= 0")):
        indices, locations = bad_table(value, table_part)
        out = run(indices, locations)
        with pytest.raises(error, match=pattern):
            tutel.cuda.check_errors()
        tutel.cuda.check_errors()  # reported once, then cleared
        # The bad choice was treated as dropped: as if its location were >= capacity.
        dropped_indices, dropped_locations = indices.clone(), locations.clone()
        dropped_indices[where_entry], dropped_locations[where_entry] = 0, 2
        assert_identical(run(dropped_indices, dropped_locations).cpu(), out)


def test_the_lowest_bad_entry_is_reported():
    indices = torch.tensor([[0, 7, 0, 8], [5, 0, 6, 0]], dtype=torch.int32, device="cuda")
    locations = torch.zeros(2, 4, dtype=torch.int32, device="cuda")
    tutel_ops.gather_slots(torch.randn(4, 2, 3, device="cuda"), indices, locations, None, None)
    with pytest.raises(IndexError, match="expert index 7 \\(choice 0, token 1\\)"):
        tutel.cuda.check_errors()


def test_an_unchecked_error_is_raised_by_the_next_cuda_operator():
    indices, locations = bad_table(9, "indices")
    tutel_ops.gather_slots(torch.randn(4, 2, 5, device="cuda"), indices, locations, None, None)
    torch.cuda.synchronize()
    with pytest.raises(IndexError, match="expert index 9.*earlier call of tutel::gather_slots"):
        tutel_ops.cumsum_sub_one(torch.ones(3, 2, device="cuda"))
    tutel_ops.cumsum_sub_one(torch.ones(3, 2, device="cuda"))  # reported once


def test_assign_locations_reports_bad_indices():
    indices = torch.tensor([[0, 4, 1]], dtype=torch.int32, device="cuda")
    locations, counts = tutel_ops.assign_locations(indices, 4, None)
    with pytest.raises(IndexError, match="tutel::assign_locations: expert index 4 \\(choice 0, token 1\\)"):
        tutel.cuda.check_errors()
    assert locations.tolist() == [[0, 2 ** 31 - 1, 0]]
    assert counts.tolist() == [[1, 1, 0, 0]]


def test_python_entry_points_report_bad_indices_on_cuda():
    x = torch.rand(3, 2, device="cuda")
    tutel.ops.encode(x, torch.tensor([[0, 9, 1]], device="cuda"), torch.zeros(1, 3, dtype=torch.int32, device="cuda"),
                     4, 2)
    with pytest.raises(IndexError, match="expert index 9"):
        tutel.cuda.check_errors(x.device)


def test_mixed_devices_are_rejected():
    rows = torch.randn(4, 2, 5, device="cuda")
    table = torch.zeros(1, 3, dtype=torch.int32)
    with pytest.raises(ValueError, match="`indices` is on cpu"):
        tutel_ops.gather_slots(rows, table, table.cuda(), None, None)
