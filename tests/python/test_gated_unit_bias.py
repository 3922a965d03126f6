"""The gated unit with the per-expert bias of rows grouped by expert (gpt-oss' biased experts):
tutel.ops.gated_units.gated_unit(gate_up, unit, bias=, offsets=) and tutel::gated_unit /
gated_unit_backward's bias and offsets arguments, against a float64 reference written out here.

Forward and the gradients of gate_up and bias, both layouts (halves, interleaved), gpt-oss'
clamped unit and SwiGLU, 1 to 70 experts with idle experts and rows past the last expert's,
n = 0, every dtype; the compiled CPU operator, the composite operators and the composite
fallback of the Python wrapper; argument errors; and on fake CUDA tensors, one launch forward
and no host synchronisation.
"""
import pytest
import torch

import tutel  # noqa: F401  (loads the operators)
from tutel.ops import composite
from tutel.ops.backend import use_operators
from tutel.ops.gated_units import SWIGLU, GatedUnit, gated_unit

from test_gated_units import reference as unit_reference, reference_grad as unit_reference_grad, split

UNIT_ROUNDING = {torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11,
                 torch.float64: 2.0 ** -53}
# The accumulation dtype's rounding (float32 for 16-bit data), exponential included.
COMPUTE_ROUNDING = {torch.float64: 2.0 ** -50}
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
UNITS = {
    "gpt_oss": GatedUnit(1.702, 1.0, 7.0, interleaved=True),
    "swiglu": SWIGLU,
    "clamped_halves": GatedUnit(1.702, 1.0, 7.0, interleaved=False),
    "swiglu_interleaved": GatedUnit(interleaved=True),
}


def experts_of_rows(rows, offsets):
    """Each row's expert: how many experts end at or before it (the first e with offsets[e] > r
    for non-decreasing ends); len(offsets) past the last expert's rows."""
    return (offsets.long()[None, :] <= torch.arange(rows)[:, None]).sum(1)


def biased_values(gate_up, bias, offsets):
    """float64 gate_up plus each row's expert bias (rows past the last expert's unchanged)."""
    values = gate_up.double().clone()
    expert = experts_of_rows(gate_up.shape[0], offsets)
    for r in range(gate_up.shape[0]):
        if expert[r] < bias.shape[0]:
            values[r] += bias[expert[r]].double()
    return values


def reference(values, grad, unit):
    """float64 h, d gate_up (values' layout) and the sizes of their terms, from the definition at
    `values` (the biased gate and up values): test_gated_units' reference, with term sizes for the
    tolerances."""
    h = unit_reference(values, unit)
    d = unit_reference_grad(values, grad, unit)[0]
    g, u = split(values, unit.interleaved)
    if unit.limit is not None:
        g, u = g.clamp(max=unit.limit), u.clamp(-unit.limit, unit.limit)
    dh = grad.double()
    up_size = u.abs() + abs(unit.up_offset)
    d_size = torch.empty_like(values)
    size_gate, size_up = split(d_size, unit.interleaved)
    size_gate.copy_(dh.abs() * up_size * (1 + abs(unit.alpha) * g.abs()))
    size_up.copy_(dh.abs() * g.abs())
    return h, d, up_size * g.abs(), d_size


def tolerance(dtype, size):
    return 8 * (UNIT_ROUNDING[dtype] + COMPUTE_ROUNDING.get(dtype, 2.0 ** -22)) * size + 1e-30


def assert_close(got, want, size, dtype, what):
    error = (got.double() - want).abs()
    bad = ~(error <= tolerance(dtype, size))  # NaN counts as bad
    assert not bad.any(), (f"{what}: {int(bad.sum())} of {bad.numel()} values off, worst error "
                           f"{float(error[bad].max()):.3g}")


def bias_gradient(d_gate_up, d_size, offsets, experts, dtype):
    """float64 per-expert sums of d gate_up, and their tolerance: each term's, the accumulation's
    (float32 for 16-bit and float32 data) and the final rounding to the bias' dtype."""
    expert = experts_of_rows(d_gate_up.shape[0], offsets)
    width = d_gate_up.shape[1]
    sums = torch.zeros(experts, width, dtype=torch.float64)
    terms = torch.zeros(experts, width, dtype=torch.float64)
    allowed = torch.zeros(experts, width, dtype=torch.float64)
    rows = torch.zeros(experts, dtype=torch.float64)
    for r in range(d_gate_up.shape[0]):
        e = int(expert[r])
        if e < experts:
            sums[e] += d_gate_up[r]
            terms[e] += d_gate_up[r].abs()
            allowed[e] += tolerance(dtype, d_size[r])
            rows[e] += 1
    accumulation = 2.0 ** -52 if dtype == torch.float64 else 2.0 ** -23
    allowed += (rows[:, None] * accumulation + UNIT_ROUNDING[dtype]) * (terms + allowed) + 1e-30
    return sums, allowed


def make_case(rows, width, experts, dtype, unit, seed, tail=True):
    """gate_up [rows, 2I] (values reaching past the clamp bounds and into the exponential's
    limited range), d h, bias [E, 2I] and random non-decreasing ends: expert 1 idle (when E > 1),
    rows past the last expert's unless `tail` is False."""
    g = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(rows, 2 * width, generator=g, dtype=torch.float64) * 4
    if rows and width >= 2:
        gate, _ = split(gate_up, unit.interleaved)
        gate[-1, 0], gate[0, -1] = -95.0, 90.0
    grad = torch.randn(rows, width, generator=g, dtype=torch.float64)
    bias = torch.randn(experts, 2 * width, generator=g, dtype=torch.float64) * 3
    ends = torch.randint(0, rows + 1, (experts,), generator=g).sort().values
    if experts > 1:
        ends[1] = ends[0]
    if not tail and experts:
        ends[-1] = rows
    return gate_up.to(dtype), grad.to(dtype), bias.to(dtype), ends.to(torch.int32)


def check_gated_unit(gate_up, grad, bias, offsets, unit, dtype):
    """The Python wrapper without and with autograd: h, d gate_up and d bias against the
    reference."""
    values = biased_values(gate_up, bias, offsets)
    want_h, want_d, h_size, d_size = reference(values, grad, unit)
    with torch.no_grad():
        h = gated_unit(gate_up, unit, bias=bias, offsets=offsets)
    assert h.dtype == dtype and h.shape == want_h.shape
    assert_close(h, want_h, h_size, dtype, "h without autograd")

    leaf = gate_up.clone().requires_grad_(True)
    bias_leaf = bias.clone().requires_grad_(True)
    h = gated_unit(leaf, unit, bias=bias_leaf, offsets=offsets)
    assert_close(h.detach(), want_h, h_size, dtype, "h with autograd")
    h.backward(grad)
    assert leaf.grad.dtype == dtype and bias_leaf.grad.dtype == dtype
    assert_close(leaf.grad, want_d, d_size, dtype, "d gate_up")
    want_bias, allowed = bias_gradient(want_d, d_size, offsets, bias.shape[0], dtype)
    error = (bias_leaf.grad.double() - want_bias).abs()
    assert not (~(error <= allowed)).any(), f"d bias off by {float(error.max()):.3g}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("unit_name", list(UNITS))
@pytest.mark.parametrize("rows,width,experts", [(0, 8, 3), (1, 1, 1), (5, 3, 1), (9, 13, 4), (33, 8, 64),
                                                (70, 9, 70), (40, 17, 5)])
def test_biased_unit_matches_the_float64_reference(dtype, unit_name, rows, width, experts):
    unit = UNITS[unit_name]
    case = make_case(rows, width, experts, dtype, unit, seed=rows * 1000 + width * 10 + experts)
    check_gated_unit(*case, unit, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_row_with_an_expert_and_leading_dims(dtype):
    """Ends reaching the last row (no tail), and gate_up [2, 15, 2I] whose flattened rows the ends
    count."""
    unit = UNITS["gpt_oss"]
    gate_up, grad, bias, offsets = make_case(30, 24, 6, dtype, unit, seed=11, tail=False)
    check_gated_unit(gate_up, grad, bias, offsets, unit, dtype)
    h = gated_unit(gate_up.view(2, 15, 48), unit, bias=bias, offsets=offsets)
    assert h.shape == (2, 15, 24)
    assert torch.equal(h.view(30, 24), gated_unit(gate_up, unit, bias=bias, offsets=offsets))


def test_the_bias_is_added_in_the_accumulation_dtype():
    """bfloat16 values whose sum bfloat16 cannot hold: 1 + 2^-9 (between two bfloat16 values),
    the SwiGLU of which differs from the rounded sum's."""
    gate_up = torch.tensor([[1.0, 1.0]], dtype=torch.bfloat16)  # g = 1, u = 1
    bias = torch.tensor([[2.0 ** -9, 0.0]], dtype=torch.bfloat16)
    offsets = torch.tensor([1], dtype=torch.int32)
    g = torch.tensor(1 + 2.0 ** -9, dtype=torch.float32)
    want = (g * torch.sigmoid(g)).to(torch.bfloat16)
    rounded_first = (torch.tensor(1.0) * torch.sigmoid(torch.tensor(1.0))).to(torch.bfloat16)
    assert want != rounded_first  # the case tells the two rules apart
    for implementation in (torch.ops.tutel.gated_unit, composite.gated_unit):
        assert implementation(gate_up, 1.0, 0.0, None, False, bias, offsets)[0, 0] == want


def test_no_experts_and_idle_experts_add_nothing():
    unit = UNITS["gpt_oss"]
    gate_up, grad, _, _ = make_case(12, 8, 1, torch.float32, unit, seed=3)
    plain = gated_unit(gate_up, unit)
    none = torch.zeros(0, 16), torch.zeros(0, dtype=torch.int32)
    assert torch.equal(gated_unit(gate_up, unit, bias=none[0], offsets=none[1]), plain)
    idle = torch.randn(4, 16), torch.zeros(4, dtype=torch.int32)  # every expert ends at row 0
    assert torch.equal(gated_unit(gate_up, unit, bias=idle[0], offsets=idle[1]), plain)
    zero_bias = torch.zeros(3, 16), torch.tensor([4, 8, 12], dtype=torch.int32)
    assert torch.equal(gated_unit(gate_up, unit, bias=zero_bias[0], offsets=zero_bias[1]), plain)
    backward = torch.ops.tutel.gated_unit_backward
    assert torch.equal(backward(grad, gate_up, 1.702, 1.0, 7.0, True, *idle),
                       backward(grad, gate_up, 1.702, 1.0, 7.0, True))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("unit_name", ["gpt_oss", "swiglu"])
@pytest.mark.parametrize("rows,width,experts", [(0, 3, 2), (1, 1, 1), (37, 19, 5), (300, 16, 64), (129, 9, 70)])
def test_composite_operators_match_the_cpu_operator(dtype, unit_name, rows, width, experts):
    """tutel.ops.composite's gated_unit / gated_unit_backward with bias and offsets (the CUDA
    fallback and the self-check's reference) against the compiled CPU operator, to the dtype's
    rounding (the exponentials differ)."""
    unit = UNITS[unit_name]
    gate_up, grad, bias, offsets = make_case(rows, width, experts, dtype, unit, seed=rows + width + experts)
    args = (unit.alpha, unit.up_offset, unit.limit, unit.interleaved, bias, offsets)
    tolerances = {torch.float64: dict(rtol=1e-13, atol=1e-13), torch.float32: dict(rtol=1e-5, atol=1e-5),
                  torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2), torch.float16: dict(rtol=2e-3, atol=2e-3)}
    for got, want in ((composite.gated_unit(gate_up, *args), torch.ops.tutel.gated_unit(gate_up, *args)),
                      (composite.gated_unit_backward(grad, gate_up, *args),
                       torch.ops.tutel.gated_unit_backward(grad, gate_up, *args))):
        assert got.dtype == want.dtype and got.shape == want.shape
        torch.testing.assert_close(got, want, equal_nan=True, **tolerances[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_composite_fallback_of_the_wrapper_matches_the_reference(dtype):
    """On a device without the operator (here: the CPU told to use the composite operators) the
    wrapper composes the unit from PyTorch operators; autograd gives both gradients."""
    unit = UNITS["gpt_oss"]
    case = make_case(45, 12, 7, dtype, unit, seed=5)
    with use_operators("composite"):
        check_gated_unit(*case, unit, dtype)
    unit = UNITS["swiglu"]
    case = make_case(45, 12, 70, dtype, unit, seed=6)
    with use_operators("composite"):
        check_gated_unit(*case, unit, dtype)


def test_bad_bias_arguments_raise_errors_naming_them():
    gate_up = torch.randn(6, 8)
    bias, offsets = torch.randn(3, 8), torch.tensor([2, 4, 6], dtype=torch.int32)
    # (A meta bias would take the compiled operators to their shape functions, which check
    # nothing: the device check is theirs on CUDA, and here the wrapper's and the composite's.)
    for call, checks_device in (
            (lambda b, o: gated_unit(gate_up, SWIGLU, bias=b, offsets=o), True),
            (lambda b, o: torch.ops.tutel.gated_unit(gate_up, 1.0, 0.0, None, False, b, o), False),
            (lambda b, o: torch.ops.tutel.gated_unit_backward(torch.randn(6, 4), gate_up, 1.0, 0.0, None, False,
                                                              b, o), False),
            (lambda b, o: composite.gated_unit(gate_up, 1.0, 0.0, None, False, b, o), True),
            (lambda b, o: composite.gated_unit_backward(torch.randn(6, 4), gate_up, 1.0, 0.0, None, False,
                                                        b, o), True)):
        with pytest.raises(ValueError, match="offsets"):
            call(bias, None)
        with pytest.raises(ValueError, match="bias"):
            call(None, offsets)
        with pytest.raises(TypeError, match="bias"):
            call(bias.double(), offsets)
        with pytest.raises(TypeError, match="offsets"):
            call(bias, offsets.long())
        with pytest.raises(ValueError, match="bias"):
            call(torch.randn(3, 6), offsets)
        with pytest.raises(ValueError, match="bias"):
            call(torch.randn(24), offsets)
        with pytest.raises(ValueError, match="offsets"):
            call(bias, offsets[:2])
        with pytest.raises(ValueError, match="offsets"):
            call(bias, offsets.view(3, 1))
        if checks_device:
            with pytest.raises(ValueError, match="bias"):
                call(bias.to("meta"), offsets)
            with pytest.raises(ValueError, match="offsets"):
                call(bias, offsets.to("meta"))
    with pytest.raises(TypeError, match="bias"):
        gated_unit(gate_up, SWIGLU, bias=[0.0] * 8, offsets=offsets)
    with pytest.raises(TypeError, match="offsets"):
        gated_unit(gate_up, SWIGLU, bias=bias, offsets=[2, 4, 6])


def test_the_operator_passes_opcheck_with_and_without_the_bias():
    from tutel.ops.gated_units import _gated_unit
    bias, offsets = torch.randn(3, 18), torch.tensor([1, 1, 4], dtype=torch.int32)
    torch.library.opcheck(_gated_unit, (torch.randn(5, 18, requires_grad=True), 1.702, 1.0, 7.0, True,
                                        bias.requires_grad_(), offsets))
    torch.library.opcheck(torch.ops.tutel.gated_unit.default, (torch.randn(5, 18), 1.0, 0.0, None, False, bias.detach(),
                                                               offsets))
    torch.library.opcheck(torch.ops.tutel.gated_unit_backward.default,
                          (torch.randn(5, 9), torch.randn(5, 18), 1.0, 0.0, None, True, bias.detach(), offsets))
    torch.library.opcheck(torch.ops.tutel.gated_unit.default, (torch.randn(5, 18), 1.0, 0.0, None, False))


def test_fake_cuda_one_launch_forward_and_no_host_synchronisation():
    """On (fake) CUDA tensors the biased unit is the one tutel::gated_unit call forward; the
    backward is one gated_unit_backward plus the bias' per-expert sums, with no value read on the
    host (the fake mode raises on one) and every shape from the inputs'."""
    launch_count = pytest.importorskip("launch_count")
    with launch_count.fake_cuda():
        gate_up = torch.randn(2048, 2 * 2880, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        bias = torch.randn(32, 2 * 2880, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        offsets = torch.randint(0, 2048, (32,), device="cuda", dtype=torch.int32)
        with launch_count.OperatorCount() as forward:
            h = gated_unit(gate_up, UNITS["gpt_oss"], bias=bias, offsets=offsets)
        assert forward.operators == ["tutel.gated_unit.default"]
        assert h.shape == (2048, 2880) and h.device.type == "cuda"
        with launch_count.OperatorCount() as backward:
            grads = launch_count.backward_by_hand(h, torch.ones_like(h))
        assert backward.operators.count("tutel.gated_unit_backward.default") == 1
        assert grads[gate_up].shape == gate_up.shape and grads[bias].shape == bias.shape
        assert grads[bias].dtype == torch.bfloat16
