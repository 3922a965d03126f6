"""Rows grouped by expert: tutel::add_expert_bias_, expert_row_sums and choice_rows, the CPU
operators and the composite versions (tutel.ops.composite.expert_rows) against float64 references
written as plain loops over the experts and slots, on random rows with idle experts, rows past the
last expert's, row-strided views, one expert and many, no rows, in every data dtype; the
composite versions against the operators; bad input; on fake CUDA tensors, one operator (one
kernel) per call with nothing read back by the host; and, with a GPU, the kernels against the CPU
operators bit for bit (contiguous, element-wise and vector row-strided views) and in a CUDA graph."""
from typing import List

import pytest
import torch

import tutel
from conftest import ALL_DTYPES, TOLERANCES
from launch_count import OperatorCount, fake_cuda
from tutel.ops import composite
from tutel.ops.backend import operators_for

native = torch.ops.tutel
IMPLEMENTATIONS = {"operator": native, "composite": composite}

# (N rows, C columns, E experts, rows past the last expert's)
SHAPES = [(0, 5, 3, 0), (1, 1, 1, 0), (1, 8, 1, 1), (7, 3, 2, 2), (37, 19, 5, 3), (64, 16, 64, 0),
          (100, 8, 65, 10), (300, 64, 300, 0), (513, 33, 128, 40), (2000, 7, 9, 500)]
# The unit roundoff of each dtype, of its accumulation dtype, and half the spacing of float16's
# subnormals (the absolute error of rounding a tiny sum to float16).
DATA_EPS = {torch.float64: 2.0 ** -53, torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8,
            torch.float16: 2.0 ** -11}
ACC_EPS = {torch.float64: 2.0 ** -53, torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -24,
           torch.float16: 2.0 ** -24}
DATA_TINY = {torch.float16: 2.0 ** -25}


def shape_id(shape) -> str:
    return "N{}_C{}_E{}_tail{}".format(*shape)


def random_ends(rows: int, experts: int, tail: int, g: torch.Generator) -> torch.Tensor:
    """[E] int32 non-decreasing ends: random group sizes with about a third of the experts idle
    (zero rows), the last end rows - tail."""
    grouped = rows - tail
    weights = torch.rand(experts, generator=g, dtype=torch.float64)
    weights = weights * (torch.rand(experts, generator=g) > 0.33)
    if float(weights.sum()) == 0:
        weights[-1] = 1.0
    ends = (weights.cumsum(0) / weights.sum() * grouped).floor().to(torch.int32)
    ends[-1] = grouped
    return ends


def grouped(rows: int, columns: int, dtype: torch.dtype, g: torch.Generator, padded: bool) -> torch.Tensor:
    """Random [rows, columns] values: contiguous, or a view into rows padded by 5 elements."""
    width = columns + 5 if padded else columns
    return (torch.randn(rows, width, generator=g, dtype=torch.float64) * 3).to(dtype)[:, :columns]


def expert_ranges(offsets: torch.Tensor) -> List[range]:
    ends = [int(end) for end in offsets]
    return [range(start, end) for start, end in zip([0] + ends[:-1], ends)]


def reference_bias(rows: torch.Tensor, bias: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """float64: rows with each expert's bias added to its rows."""
    out = rows.double().clone()
    for expert, span in enumerate(expert_ranges(offsets)):
        for r in span:
            out[r] += bias[expert].double()
    return out


def reference_sums(rows: torch.Tensor, offsets: torch.Tensor):
    """float64 (sums, sums of magnitudes, row counts) per expert."""
    experts, columns = offsets.shape[0], rows.shape[1]
    sums = torch.zeros(experts, columns, dtype=torch.float64)
    magnitudes = torch.zeros_like(sums)
    counts = torch.zeros(experts, 1, dtype=torch.float64)
    for expert, span in enumerate(expert_ranges(offsets)):
        for r in span:
            sums[expert] += rows[r].double()
            magnitudes[expert] += rows[r].double().abs()
            counts[expert] += 1
    return sums, magnitudes, counts


def reference_choice_rows(x: torch.Tensor, slot_choices: torch.Tensor, k: int) -> torch.Tensor:
    out = torch.zeros(slot_choices.shape[0], x.shape[1], dtype=x.dtype)
    for slot, choice in enumerate(slot_choices.tolist()):
        out[slot] = x[choice // k]
    return out


def assert_sums_close(got: torch.Tensor, sums, magnitudes, counts, dtype: torch.dtype) -> None:
    """Each sum within its accumulation dtype's rounding of (count + 1) additions of terms of the
    given magnitude, then one rounding to the data dtype."""
    assert got.dtype == dtype and got.shape == sums.shape
    bound = (counts + 1) * ACC_EPS[dtype] * magnitudes * (1 + DATA_EPS[dtype]) + DATA_EPS[dtype] * sums.abs() + \
        DATA_TINY.get(dtype, 0.0)
    error = (got.double() - sums).abs()
    assert bool((error <= bound).all()), f"largest error over bound: {float((error - bound).max())}"


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bits as integers (so -0.0 differs from +0.0 and NaN equals itself)."""
    return t.contiguous().view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def assert_same(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal values, dtypes and shapes (a NaN equal to a NaN)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num(0.0), want.nan_to_num(0.0))


# ------------------------------------------------------------------------- add_expert_bias_ --
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("padded", [False, True], ids=["contiguous", "padded"])
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_add_expert_bias_matches_float64_reference(dtype, shape, padded, implementation):
    rows_count, columns, experts, tail = shape
    g = torch.Generator().manual_seed(hash(shape) % 1000 + padded)
    rows = grouped(rows_count, columns, dtype, g, padded)
    base = rows._base if padded else None
    before = (base if padded else rows).clone()
    bias = (torch.randn(experts, columns, generator=g, dtype=torch.float64) * 3).to(dtype)
    offsets = random_ends(rows_count, experts, tail, g)
    want = reference_bias(rows, bias, offsets)
    result = getattr(IMPLEMENTATIONS[implementation], "add_expert_bias_")(rows, bias, offsets)
    assert result is None
    torch.testing.assert_close(rows, want.to(dtype), **TOLERANCES[dtype])
    grouped_rows = rows_count - tail
    # The rows of no expert, and the padding between rows, keep their bits.
    assert torch.equal(bits(rows[grouped_rows:]), bits(before[grouped_rows:, :columns]))
    if padded:
        assert torch.equal(bits(base[:, columns:]), bits(before[:, columns:]))


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_add_expert_bias_keeps_negative_zero_and_nan_of_rows_past_the_experts(dtype):
    rows = torch.tensor([[1.0, 2.0], [-0.0, float("nan")], [-0.0, 3.0]], dtype=dtype)
    bias = torch.tensor([[0.5, -0.0]], dtype=dtype)
    offsets = torch.tensor([1], dtype=torch.int32)
    for implementation in IMPLEMENTATIONS.values():
        out = rows.clone()
        implementation.add_expert_bias_(out, bias, offsets)
        assert out[0].tolist() == [1.5, 2.0]
        assert torch.equal(bits(out[1:]), bits(rows[1:]))  # -0.0 and NaN bits kept


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_composite_add_expert_bias_is_the_operator_bit_for_bit(dtype):
    g = torch.Generator().manual_seed(3)
    rows = grouped(700, 24, dtype, g, True)
    bias = torch.randn(40, 24, generator=g).to(dtype)
    offsets = random_ends(700, 40, 55, g)
    a, b = rows.clone(), rows.clone()
    native.add_expert_bias_(a, bias, offsets)
    composite.add_expert_bias_(b, bias, offsets)
    assert torch.equal(bits(a), bits(b))


# -------------------------------------------------------------------------- expert_row_sums --
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("layout", ["contiguous", "padded", "transposed"])
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_expert_row_sums_match_float64_reference(dtype, shape, layout, implementation):
    rows_count, columns, experts, tail = shape
    g = torch.Generator().manual_seed(hash(shape) % 997 + len(layout))
    rows = grouped(rows_count, columns, dtype, g, layout == "padded")
    if layout == "transposed":  # elements strided within each row (the operator copies it)
        rows = rows.t().contiguous().t()
    offsets = random_ends(rows_count, experts, tail, g)
    got = getattr(IMPLEMENTATIONS[implementation], "expert_row_sums")(rows, offsets)
    sums, magnitudes, counts = reference_sums(rows, offsets)
    assert_sums_close(got, sums, magnitudes, counts, dtype)
    idle = counts.squeeze(1) == 0
    assert bool((got[idle] == 0).all())


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_expert_row_sums_are_row_order_sums_in_the_accumulation_dtype(dtype):
    """The operator adds each expert's rows in row order from +0 in float32 (float64 for float64)
    and rounds once: the same bits as that loop, whatever the threads."""
    g = torch.Generator().manual_seed(11)
    rows = grouped(900, 40, dtype, g, False)
    offsets = random_ends(900, 12, 70, g)
    accumulation = torch.float64 if dtype == torch.float64 else torch.float32
    want = torch.zeros(12, 40, dtype=accumulation)
    for expert, span in enumerate(expert_ranges(offsets)):
        for r in span:
            want[expert] += rows[r].to(accumulation)
    assert torch.equal(native.expert_row_sums(rows, offsets), want.to(dtype))


def test_expert_row_sums_of_no_experts_and_no_rows():
    rows = torch.randn(6, 4)
    assert native.expert_row_sums(rows, torch.zeros(0, dtype=torch.int32)).shape == (0, 4)
    assert composite.expert_row_sums(rows, torch.zeros(0, dtype=torch.int32)).shape == (0, 4)
    empty = torch.zeros(0, 4, dtype=torch.bfloat16)
    for implementation in IMPLEMENTATIONS.values():
        out = implementation.expert_row_sums(empty, torch.zeros(3, dtype=torch.int32))
        assert out.dtype == torch.bfloat16 and torch.equal(out, torch.zeros(3, 4, dtype=torch.bfloat16))
    for implementation in IMPLEMENTATIONS.values():  # no experts: nothing added
        before = rows.clone()
        implementation.add_expert_bias_(rows, torch.zeros(0, 4), torch.zeros(0, dtype=torch.int32))
        assert torch.equal(rows, before)


# ------------------------------------------------------------------------------ choice_rows --
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("padded", [False, True], ids=["contiguous", "padded"])
@pytest.mark.parametrize("tokens,columns,k", [(0, 4, 2), (1, 1, 1), (3, 8, 4), (37, 19, 2), (64, 64, 8),
                                              (513, 33, 3), (1000, 16, 1)])
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_choice_rows_match_reference(dtype, tokens, columns, k, padded, implementation):
    g = torch.Generator().manual_seed(tokens * 7 + columns + k)
    x = grouped(tokens, columns, dtype, g, padded)
    # group_by_expert's slot choices (a permutation of the T k choices), then a few repeated ones
    ids = torch.randint(0, 5, (tokens, k), generator=g)
    slot_choices = native.group_by_expert(ids, 5)[1]
    slot_choices = torch.cat([slot_choices, slot_choices[: min(3, slot_choices.numel())]])
    got = getattr(IMPLEMENTATIONS[implementation], "choice_rows")(x, slot_choices, k)
    assert_same(got, reference_choice_rows(x, slot_choices, k))
    assert got.is_contiguous()


def test_choice_rows_of_no_slots_and_strided_elements():
    x = torch.randn(5, 6, dtype=torch.float64)
    for implementation in IMPLEMENTATIONS.values():
        assert implementation.choice_rows(x, torch.zeros(0, dtype=torch.int64), 3).shape == (0, 6)
        transposed = x.t().contiguous().t()
        choices = torch.tensor([14, 0, 7, 3], dtype=torch.int64)
        assert_same(implementation.choice_rows(transposed, choices, 3), reference_choice_rows(x, choices, 3))


def test_composite_choice_rows_give_zero_rows_for_choices_out_of_range():
    """As the CUDA kernel does; the CPU operator raises instead (below)."""
    x = torch.randn(4, 3)
    got = composite.choice_rows(x, torch.tensor([-1, 0, 8, 7, 100], dtype=torch.int64), 2)
    assert torch.equal(got, torch.stack([torch.zeros(3), x[0], torch.zeros(3), x[3], torch.zeros(3)]))
    assert torch.equal(composite.choice_rows(x[:0], torch.tensor([0, 1]), 2), torch.zeros(2, 3))


# ------------------------------------------------------------------------------- bad input --
def bias_args():
    return torch.randn(10, 4), torch.randn(3, 4), torch.tensor([2, 5, 9], dtype=torch.int32)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_bad_shapes_and_dtypes_name_the_argument(implementation):
    ops = IMPLEMENTATIONS[implementation]
    rows, bias, offsets = bias_args()
    cases = [
        (ValueError, "rows", lambda: ops.add_expert_bias_(rows[0], bias, offsets)),
        (TypeError, "rows", lambda: ops.add_expert_bias_(rows.int(), bias.int(), offsets)),
        (TypeError, "bias", lambda: ops.add_expert_bias_(rows, bias.double(), offsets)),
        (ValueError, "bias", lambda: ops.add_expert_bias_(rows, bias[:2], offsets)),
        (ValueError, "bias", lambda: ops.add_expert_bias_(rows, bias[:, :3], offsets)),
        (TypeError, "offsets", lambda: ops.add_expert_bias_(rows, bias, offsets.long())),
        (ValueError, "offsets", lambda: ops.add_expert_bias_(rows, bias, offsets.view(1, 3))),
        (ValueError, "rows", lambda: ops.expert_row_sums(rows[0], offsets)),
        (TypeError, "rows", lambda: ops.expert_row_sums(rows.long(), offsets)),
        (TypeError, "offsets", lambda: ops.expert_row_sums(rows, offsets.float())),
        (ValueError, "x", lambda: ops.choice_rows(rows[0], torch.zeros(2, dtype=torch.int64), 2)),
        (TypeError, "x", lambda: ops.choice_rows(rows.int(), torch.zeros(2, dtype=torch.int64), 2)),
        (TypeError, "slot_choices", lambda: ops.choice_rows(rows, torch.zeros(2, dtype=torch.int32), 2)),
        (ValueError, "slot_choices", lambda: ops.choice_rows(rows, torch.zeros(2, 1, dtype=torch.int64), 2)),
        (ValueError, "k", lambda: ops.choice_rows(rows, torch.zeros(2, dtype=torch.int64), 0)),
    ]
    for error, name, call in cases:
        with pytest.raises(error, match=f"`{name}`"):
            call()


def test_the_operator_rejects_rows_it_cannot_write_in_place():
    rows, bias, offsets = bias_args()
    with pytest.raises(ValueError, match="`rows` must have contiguous elements within each row"):
        native.add_expert_bias_(rows.t().contiguous().t(), bias, offsets)
    overlapping = torch.randn(22).as_strided((10, 4), (2, 1))
    with pytest.raises(ValueError, match="rows that do not overlap"):
        native.add_expert_bias_(overlapping, bias, offsets)


@pytest.mark.parametrize("ends", [[5, 3, 9], [2, 5, 11], [-1, 5, 9]], ids=["decreasing", "past_N", "negative"])
def test_the_cpu_operators_reject_bad_offsets(ends):
    rows, bias, _ = bias_args()
    offsets = torch.tensor(ends, dtype=torch.int32)
    before = rows.clone()
    with pytest.raises(ValueError, match="`offsets` must be non-decreasing ends of the experts' rows within"):
        native.add_expert_bias_(rows, bias, offsets)
    assert torch.equal(rows, before)  # checked before anything is written
    with pytest.raises(ValueError, match="`offsets`"):
        native.expert_row_sums(rows, offsets)


@pytest.mark.parametrize("choice", [-1, 20, 2 ** 62])
def test_the_cpu_operator_rejects_slot_choices_out_of_range(choice):
    x = torch.randn(10, 4)
    slot_choices = torch.tensor([0, 3, choice, 5], dtype=torch.int64)
    with pytest.raises(IndexError, match=r"`slot_choices`\[2\] = .* out of range; choices must satisfy 0 <= choice "
                                         r"< T k = 10 \* 2"):
        native.choice_rows(x, slot_choices, 2)


# --------------------------------------------------------------------- the CUDA path, faked --
@pytest.fixture
def default_backend(monkeypatch):
    monkeypatch.delenv("TUTEL_CUDA_BACKEND", raising=False)


def fake_problem(dtype):
    rows = torch.randn(40, 24 + 8, device="cuda", dtype=dtype)[:, :24]  # row-strided, read in place
    bias = torch.randn(5, 24, device="cuda", dtype=dtype)
    offsets = torch.arange(1, 6, device="cuda", dtype=torch.int32) * 7
    x = torch.randn(10, 24, device="cuda", dtype=dtype)
    slot_choices = torch.randperm(30, device="cuda")
    return rows, bias, offsets, x, slot_choices


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_fake_cuda_each_operator_is_one_kernel_and_reads_nothing_back(dtype, default_backend):
    with fake_cuda():
        rows, bias, offsets, x, slot_choices = fake_problem(dtype)
        ops = operators_for(rows.device)  # what a CUDA build runs (no self-check on fake tensors)
        with torch.no_grad(), OperatorCount() as count:
            assert ops.add_expert_bias_(rows, bias, offsets) is None
        assert count.operators == ["tutel.add_expert_bias_.default"] and count.kernels == 1
        with torch.no_grad(), OperatorCount() as count:
            sums = ops.expert_row_sums(rows, offsets)
        assert count.operators == ["tutel.expert_row_sums.default"] and count.kernels == 1
        assert sums.shape == (5, 24) and sums.dtype == dtype and sums.device.type == "cuda"
        with torch.no_grad(), OperatorCount() as count:
            out = ops.choice_rows(x, slot_choices, 3)
        assert count.operators == ["tutel.choice_rows.default"] and count.kernels == 1
        assert out.shape == (30, 24) and out.dtype == dtype and out.device.type == "cuda"


def test_fake_cuda_composite_versions_read_nothing_back():
    """TUTEL_CUDA_BACKEND=composite's versions: several launches each, none waiting for the host."""
    with fake_cuda():
        rows, bias, offsets, x, slot_choices = fake_problem(torch.bfloat16)
        with torch.no_grad(), OperatorCount() as count:
            composite.add_expert_bias_(rows, bias, offsets)
            sums = composite.expert_row_sums(rows, offsets)
            out = composite.choice_rows(x, slot_choices, 3)
        assert sums.shape == (5, 24) and sums.dtype == torch.bfloat16
        assert out.shape == (30, 24)
        assert not any(name.startswith("tutel.") for name in count.operators)


# ------------------------------------------------------------------------ on a CUDA device --
cuda_available = torch.cuda.is_available() and tutel.cuda.is_built()


def on_cuda(t: torch.Tensor) -> torch.Tensor:
    """A CUDA copy of `t` with its strides (a row-strided view stays one)."""
    copy = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cuda")
    return copy.copy_(t)


@pytest.mark.skipif(not cuda_available, reason="needs a CUDA device and tutel built with CUDA")
@pytest.mark.parametrize("padding", [0, 5, 8], ids=["contiguous", "padded_scalar", "padded_vector"])
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_cuda_kernels_are_the_cpu_operators_bit_for_bit(dtype, shape, padding):
    rows_count, columns, experts, tail = shape
    g = torch.Generator().manual_seed(hash(shape) % 991 + padding)
    rows = (torch.randn(rows_count, columns + padding, generator=g) * 3).to(dtype)[:, :columns]
    bias = torch.randn(experts, columns, generator=g).to(dtype)
    offsets = random_ends(rows_count, experts, tail, g)
    sums = native.expert_row_sums(on_cuda(rows), offsets.cuda())
    assert torch.equal(bits(sums.cpu()), bits(native.expert_row_sums(rows, offsets)))
    gpu = on_cuda(rows)
    native.add_expert_bias_(gpu, bias.cuda(), offsets.cuda())
    native.add_expert_bias_(rows, bias, offsets)
    assert torch.equal(bits(gpu.cpu()), bits(rows))
    k = 1 + experts % 3
    slot_choices = torch.randperm(rows_count * k, generator=g)
    got = native.choice_rows(on_cuda(rows), slot_choices.cuda(), k)
    assert torch.equal(bits(got.cpu()), bits(native.choice_rows(rows, slot_choices, k)))


@pytest.mark.skipif(not cuda_available, reason="needs a CUDA device and tutel built with CUDA")
def test_cuda_operators_capture_in_a_graph_and_give_zero_rows_for_bad_choices():
    rows = torch.randn(300, 40, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(16, 40, device="cuda", dtype=torch.bfloat16)
    offsets = (torch.arange(1, 17, device="cuda", dtype=torch.int32) * 17).clamp(max=290).to(torch.int32)
    slot_choices = torch.randperm(600, device="cuda")
    x = torch.randn(150, 40, device="cuda", dtype=torch.bfloat16)
    work = rows.clone()
    native.add_expert_bias_(work, bias, offsets), native.expert_row_sums(rows, offsets)  # compile first
    native.choice_rows(x, slot_choices, 4)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    work.copy_(rows)
    with torch.cuda.graph(graph):  # fails if any of them synchronises with the host
        native.add_expert_bias_(work, bias, offsets)
        sums = native.expert_row_sums(rows, offsets)
        chosen = native.choice_rows(x, slot_choices, 4)
    work.copy_(rows)
    graph.replay()
    torch.cuda.synchronize()
    want = rows.cpu()
    native.add_expert_bias_(want, bias.cpu(), offsets.cpu())
    assert torch.equal(work.cpu(), want)
    assert torch.equal(sums.cpu(), native.expert_row_sums(rows.cpu(), offsets.cpu()))
    assert torch.equal(chosen.cpu(), native.choice_rows(x.cpu(), slot_choices.cpu(), 4))
    bad = torch.tensor([-1, 0, 600, 599, 2 ** 62], device="cuda")
    got = native.choice_rows(x, bad, 4).cpu()
    assert torch.equal(got, torch.stack([torch.zeros(40), x[0].cpu().float(), torch.zeros(40), x[149].cpu().float(),
                                         torch.zeros(40)]).to(torch.bfloat16))
