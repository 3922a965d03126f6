"""tutel.ops.gated_units: the fused gated activation (core/gated_units.h) forward and backward
against a float64 reference written out here, for SwiGLU and gpt-oss' clamped interleaved unit.

Widths straddle the 8-unit vector blocks (1, 5, 8, 13, 64, 67: the vector kernel, its scalar tail,
and the tail alone), 0 to 33 rows, every storage dtype; values reach past the clamp bound and
into the exponential's limited range, and the clamp bounds themselves are hit exactly (the
gradient passes at the bound, as torch.clamp's does).
"""
import pytest
import torch

import tutel  # noqa: F401  (loads the operators)
from tutel.ops.gated_units import SWIGLU, GatedUnit, gated_unit

UNIT_ROUNDING = {torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11,
                 torch.float64: 2.0 ** -53}
COMPUTE_ROUNDING = {torch.float64: 2.0 ** -50}  # float kernels: a few float32 ulps (exp included)
GPT_OSS = GatedUnit(1.702, 1.0, 7.0, interleaved=True)
UNITS = {
    "swiglu": SWIGLU,
    "gpt_oss": GPT_OSS,
    "clamped_concatenated": GatedUnit(1.702, 1.0, 7.0, interleaved=False),
    "swiglu_interleaved": GatedUnit(interleaved=True),
    "offset_no_clamp": GatedUnit(0.5, -2.0, None, interleaved=False),
}
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def split(gate_up, interleaved):
    if interleaved:
        return gate_up[:, 0::2], gate_up[:, 1::2]
    width = gate_up.shape[1] // 2
    return gate_up[:, :width], gate_up[:, width:]


def reference(gate_up, unit):
    """float64 h = (u' + offset) * g' * sigmoid(alpha g'), element by element from the definition."""
    g, u = split(gate_up.double(), unit.interleaved)
    if unit.limit is not None:
        g = torch.minimum(g, torch.tensor(unit.limit, dtype=torch.float64))
        u = u.clamp(-unit.limit, unit.limit)
    return (u + unit.up_offset) * g / (1 + torch.exp(-unit.alpha * g))


def reference_grad(gate_up, grad, unit):
    """float64 d gate_up from the derivative written out (gradient passes at the bounds)."""
    g_in, u_in = split(gate_up.double(), unit.interleaved)
    dh = grad.double()
    g, u = g_in, u_in
    gate_passes = torch.ones_like(g, dtype=torch.bool)
    up_passes = torch.ones_like(u, dtype=torch.bool)
    if unit.limit is not None:
        gate_passes = g_in <= unit.limit
        up_passes = (u_in >= -unit.limit) & (u_in <= unit.limit)
        g = g_in.clamp(max=unit.limit)
        u = u_in.clamp(-unit.limit, unit.limit)
    s = 1 / (1 + torch.exp(-unit.alpha * g))
    dg = torch.where(gate_passes, dh * (u + unit.up_offset) * s * (1 + unit.alpha * g * (1 - s)), 0.0)
    du = torch.where(up_passes, dh * g * s, 0.0)
    out = torch.empty(gate_up.shape, dtype=torch.float64)
    out_g, out_u = split(out, unit.interleaved)
    out_g.copy_(dg)
    out_u.copy_(du)
    return out, dg, du


def magnitudes(gate_up, grad, unit):
    """Bounds of |h|, |d g| and |d u| built from absolute values: the scale of their rounding."""
    g, u = split(gate_up.double().abs(), unit.interleaved)
    if unit.limit is not None:
        g, u = g.clamp(max=unit.limit), u.clamp(max=unit.limit)
    up = u + abs(unit.up_offset)
    dh = grad.double().abs()
    return up * g, dh * up * (1 + abs(unit.alpha) * g), dh * g


def assert_close(got, want, magnitude, dtype, what):
    tolerance = 8 * (UNIT_ROUNDING[dtype] + COMPUTE_ROUNDING.get(dtype, 2.0 ** -22)) * magnitude + 1e-30
    error = (got.double() - want).abs()
    bad = error > tolerance
    assert not bad.any(), (f"{what}: {int(bad.sum())} of {bad.numel()} values off, worst error "
                           f"{float(error.max()):.3g} at tolerance {float(tolerance[bad].min()):.3g}")


def make_gate_up(rows, width, dtype, unit, seed):
    generator = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(rows, 2 * width, generator=generator, dtype=torch.float64) * 5
    if rows and width and unit.limit is not None:
        g, u = split(gate_up, unit.interleaved)
        g[0, 0] = unit.limit  # exactly at the bounds: the gradient still passes
        u[0, 0] = -unit.limit
        u[-1, -1] = unit.limit
    if rows and width >= 3:
        g, _ = split(gate_up, unit.interleaved)
        g[-1, 1] = -95.0  # the exponential's limited range: sigmoid ~ 0
        g[-1, 2] = 90.0
    return gate_up.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("unit_name", list(UNITS))
@pytest.mark.parametrize("rows,width", [(0, 8), (1, 1), (1, 8), (3, 5), (2, 13), (33, 64), (7, 67)])
def test_forward_and_backward_match_the_float64_reference(dtype, unit_name, rows, width):
    unit = UNITS[unit_name]
    gate_up = make_gate_up(rows, width, dtype, unit, seed=rows * 100 + width)
    grad = torch.randn(rows, width, generator=torch.Generator().manual_seed(width), dtype=torch.float64).to(dtype)
    mag_h, mag_dg, mag_du = magnitudes(gate_up, grad, unit)
    with torch.no_grad():  # the direct operator path
        h = gated_unit(gate_up, unit)
    assert h.dtype == dtype and h.shape == (rows, width)
    assert_close(h, reference(gate_up, unit), mag_h, dtype, "h without autograd")

    leaf = gate_up.clone().requires_grad_(True)
    h = gated_unit(leaf, unit)  # the autograd operator path
    assert_close(h.detach(), reference(gate_up, unit), mag_h, dtype, "h with autograd")
    h.backward(grad)
    _, want_dg, want_du = reference_grad(gate_up, grad, unit)
    got_dg, got_du = split(leaf.grad, unit.interleaved)
    assert_close(got_dg, want_dg, mag_dg, dtype, "d gate")
    assert_close(got_du, want_du, mag_du, dtype, "d up")


def test_leading_dims_are_kept_and_rows_may_be_strided_views():
    gate_up = torch.randn(4, 3, 2 * 24, dtype=torch.float64)
    h = gated_unit(gate_up.float(), GPT_OSS)
    assert h.shape == (4, 3, 24)
    want = reference(gate_up.reshape(12, 48), GPT_OSS).view(4, 3, 24)
    assert_close(h, want, magnitudes(gate_up.reshape(12, 48), torch.ones(12, 24), GPT_OSS)[0].view(4, 3, 24),
                 torch.float32, "3-D")
    wide = torch.randn(6, 100, dtype=torch.float64)
    view = wide[:, 10:10 + 2 * 16]  # rows with a stride of 100
    h = torch.ops.tutel.gated_unit(view.float(), 1.0, 0.0, None, False)
    assert_close(h, reference(view, SWIGLU), magnitudes(view, torch.ones(6, 16), SWIGLU)[0], torch.float32,
                 "strided rows")


def test_nan_propagates_like_pytorch():
    gate_up = torch.tensor([[float("nan"), 1.0, 2.0, float("nan")] + [0.5] * 12])  # concatenated, I = 8
    h = gated_unit(gate_up, SWIGLU)
    assert torch.isnan(h[0, 0]) and torch.isnan(h[0, 3])
    assert torch.isfinite(h[0, [1, 2, 4, 5, 6, 7]]).all()
    clamped = gated_unit(gate_up, GatedUnit(1.702, 1.0, 7.0, interleaved=False))
    assert torch.isnan(clamped[0, 0]) and torch.isnan(clamped[0, 3])  # torch.clamp keeps NaN


def test_matches_transformers_gpt_oss_gate():
    """The unit named for gpt-oss is transformers' GptOssExperts._apply_gate."""
    transformers_gpt_oss = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")
    gate_up = torch.randn(9, 2 * 40, dtype=torch.float64) * 5

    class Settings:
        alpha, limit = 1.702, 7.0
    want = transformers_gpt_oss.GptOssExperts._apply_gate(Settings(), gate_up)
    got = gated_unit(gate_up.float(), GPT_OSS)
    assert_close(got, want, magnitudes(gate_up, torch.ones(9, 40), GPT_OSS)[0], torch.float32, "gpt-oss")


def test_bad_arguments_raise_clear_errors():
    with pytest.raises(ValueError, match="must be even"):
        gated_unit(torch.randn(2, 7), SWIGLU)
    with pytest.raises(ValueError, match="limit None or a finite number > 0"):
        gated_unit(torch.randn(2, 8), GatedUnit(limit=-1.0))
    with pytest.raises(ValueError, match="alpha and up_offset must be finite"):
        gated_unit(torch.randn(2, 8), GatedUnit(alpha=float("nan")))
    with pytest.raises(ValueError, match="limit"):
        torch.ops.tutel.gated_unit(torch.randn(2, 8), 1.0, 0.0, -1.0, False)
    with pytest.raises(ValueError, match="finite"):
        torch.ops.tutel.gated_unit(torch.randn(2, 8), float("inf"), 0.0, None, False)
    with pytest.raises(ValueError, match="grad"):
        torch.ops.tutel.gated_unit_backward(torch.randn(3, 4), torch.randn(2, 8), 1.0, 0.0, None, False)
    with pytest.raises(TypeError, match="float32"):
        torch.ops.tutel.gated_unit(torch.ones(2, 8, dtype=torch.int32), 1.0, 0.0, None, False)
    with pytest.raises(TypeError, match="gate_up"):
        gated_unit(torch.ones(2, 8, dtype=torch.int32), SWIGLU)


PAIR_UNITS = [name for name, unit in UNITS.items() if not unit.interleaved]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("unit_name", PAIR_UNITS)
@pytest.mark.parametrize("rows,width", [(0, 8), (1, 1), (3, 5), (2, 13), (33, 64), (7, 67)])
def test_pair_of_tensors_matches_the_float64_reference(dtype, unit_name, rows, width):
    """gated_unit_pair: gates and ups in two tensors, the gates a view with a wider row stride."""
    from tutel.ops.gated_units import gated_unit_pair
    unit = UNITS[unit_name]
    gate_up = make_gate_up(rows, width, dtype, unit, seed=rows * 101 + width)
    gate_values, up_values = split(gate_up, False)
    wide = torch.zeros(rows, width + 9, dtype=dtype)
    wide[:, 4:4 + width] = gate_values
    grad = torch.randn(rows, width, generator=torch.Generator().manual_seed(width + 1), dtype=torch.float64).to(dtype)
    mag_h, mag_dg, mag_du = magnitudes(gate_up, grad, unit)
    with torch.no_grad():
        h = gated_unit_pair(wide[:, 4:4 + width], up_values.contiguous(), unit)
    assert h.dtype == dtype and h.shape == (rows, width)
    assert_close(h, reference(gate_up, unit), mag_h, dtype, "h without autograd")

    gate = wide[:, 4:4 + width].clone().requires_grad_(True)
    up = up_values.clone().requires_grad_(True)
    h = gated_unit_pair(gate, up, unit)
    assert_close(h.detach(), reference(gate_up, unit), mag_h, dtype, "h with autograd")
    h.backward(grad)
    _, want_dg, want_du = reference_grad(gate_up, grad, unit)
    assert_close(gate.grad, want_dg, mag_dg, dtype, "d gate")
    assert_close(up.grad, want_du, mag_du, dtype, "d up")


def test_pair_keeps_leading_dims_and_passes_opcheck():
    from tutel.ops.gated_units import _gated_unit_pair, gated_unit_pair
    gate, up = torch.randn(2, 3, 16, dtype=torch.float64), torch.randn(2, 3, 16, dtype=torch.float64)
    h = gated_unit_pair(gate.float(), up.float())
    assert h.shape == (2, 3, 16)
    want = reference(torch.cat([gate, up], dim=-1).view(6, 32), SWIGLU).view(2, 3, 16)
    torch.testing.assert_close(h.double(), want, rtol=1e-5, atol=1e-6)
    torch.library.opcheck(_gated_unit_pair, (torch.randn(5, 9, requires_grad=True), torch.randn(5, 9), 1.0, 0.0, None))
    torch.library.opcheck(torch.ops.tutel.gated_unit_pair.default, (torch.randn(5, 9), torch.randn(5, 9), 1.7, 1.0, 7.0))
    torch.library.opcheck(torch.ops.tutel.gated_unit_pair_backward.default,
                          (torch.randn(5, 9), torch.randn(5, 9), torch.randn(5, 9), 1.0, 0.0, None))


def test_pair_bad_arguments_raise_clear_errors():
    from tutel.ops.gated_units import gated_unit_pair
    with pytest.raises(ValueError, match="`up` must be a tensor of the shape"):
        gated_unit_pair(torch.randn(2, 8), torch.randn(2, 7))
    with pytest.raises(ValueError, match="`up` must be a tensor of the shape"):
        gated_unit_pair(torch.randn(2, 8), torch.randn(2, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match="interleaved"):
        gated_unit_pair(torch.randn(2, 8), torch.randn(2, 8), GPT_OSS)
    with pytest.raises(ValueError, match="limit None or a finite number > 0"):
        gated_unit_pair(torch.randn(2, 8), torch.randn(2, 8), GatedUnit(limit=0.0))
    with pytest.raises(ValueError, match="`up` must have the shape"):
        torch.ops.tutel.gated_unit_pair(torch.randn(2, 8), torch.randn(3, 8), 1.0, 0.0, None)
    with pytest.raises(ValueError, match="grad"):
        torch.ops.tutel.gated_unit_pair_backward(torch.randn(2, 7), torch.randn(2, 8), torch.randn(2, 8), 1.0, 0.0,
                                                 None)
    with pytest.raises(TypeError, match="gate"):
        gated_unit_pair(torch.ones(2, 8, dtype=torch.int32), torch.ones(2, 8, dtype=torch.int32))
