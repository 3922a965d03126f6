"""group_by_expert and the gated units: the composite operators (tutel.ops.composite) against
the compiled CPU operators on random inputs (group_by_expert exactly; the gated units to their
dtype's rounding), the self-check's comparison of them, and, with a GPU, the CUDA kernels against
the CPU operators and without host synchronisation."""
import pytest
import torch

from tutel.ops import composite
from tutel.ops.self_check import compare_operators

native = torch.ops.tutel
CPU = torch.device("cpu")
cuda_available = torch.cuda.is_available() and getattr(torch.ops.tutel, "gated_unit", None) is not None
DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
UNITS = ((1.0, 0.0, None, False), (1.702, 1.0, 7.0, True), (0.5, -0.25, 3.0, False), (1.0, 0.0, None, True))
TOLERANCES = {torch.float64: dict(rtol=1e-13, atol=1e-13), torch.float32: dict(rtol=1e-5, atol=1e-5),
              torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2), torch.float16: dict(rtol=2e-3, atol=2e-3)}


def random_ids(tokens, k, experts, dtype, generator):
    """Ids with repeats and some outside [0, E): negative, E and far beyond."""
    ids = torch.randint(0, experts, (tokens, k), generator=generator)
    bad = torch.rand(tokens, k, generator=generator) < 0.1
    outside = torch.tensor([-1, experts, experts + 1000, -(2 ** 31)])
    ids = torch.where(bad, outside[torch.randint(0, 4, (tokens, k), generator=generator)], ids)
    return ids.to(dtype)


@pytest.mark.parametrize("tokens,k,experts", [(0, 2, 3), (1, 1, 1), (2, 3, 2), (37, 2, 5), (513, 8, 256),
                                              (3001, 4, 300), (64, 1, 9000), (5, 0, 4)])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.int16, torch.uint8])
def test_group_by_expert_composite_equals_cpu(tokens, k, experts, dtype):
    g = torch.Generator().manual_seed(tokens * 31 + k * 7 + experts)
    ids = random_ids(tokens, k, experts, torch.int64, g)
    if dtype == torch.uint8:
        ids = ids.clamp(min=0, max=255)
    ids = ids.to(dtype)
    for view in (ids, ids.t().contiguous().t()):
        want = native.group_by_expert(view, experts)
        got = composite.group_by_expert(view, experts)
        assert len(got) == 5
        for w, r in zip(want, got):
            assert w.dtype == r.dtype and w.shape == r.shape
            assert torch.equal(w, r)


def test_group_by_expert_composite_rejects_what_the_operator_rejects():
    with pytest.raises(ValueError, match="num_experts"):
        composite.group_by_expert(torch.zeros(2, 2, dtype=torch.int64), 0)
    with pytest.raises(TypeError, match="integers"):
        composite.group_by_expert(torch.zeros(2, 2), 3)
    with pytest.raises(ValueError, match=r"\[T, k\]"):
        composite.group_by_expert(torch.zeros(4, dtype=torch.int64), 3)


def unit_values(rows, columns, dtype, generator):
    """Normal values, the clamp bounds, NaN, -0, ±90 and ±inf."""
    values = torch.randn(rows, columns, generator=generator, dtype=torch.float64) * 4
    specials = torch.tensor([7.0, -7.0, 3.0, -3.0, float("nan"), -0.0, 90.0, -90.0, float("inf"), float("-inf")],
                            dtype=torch.float64)
    pick = torch.randint(0, 50, (rows, columns), generator=generator)
    values = torch.where(pick < len(specials), specials[pick.clamp(max=len(specials) - 1)], values)
    return values.to(dtype)


def assert_close(got, want):
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got, want, equal_nan=True, **TOLERANCES[want.dtype])


@pytest.mark.parametrize("rows,width", [(0, 3), (1, 1), (3, 0), (37, 19), (300, 65), (3000, 3)])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("unit", UNITS)
def test_gated_units_composite_match_cpu(rows, width, dtype, unit):
    g = torch.Generator().manual_seed(rows * 3 + width)
    alpha, offset, limit, interleaved = unit
    gate_up = unit_values(rows, 2 * width, dtype, g)
    grad = unit_values(rows, width, dtype, g)
    assert_close(composite.gated_unit(gate_up, *unit), native.gated_unit(gate_up, *unit))
    assert_close(composite.gated_unit_backward(grad, gate_up, *unit), native.gated_unit_backward(grad, gate_up, *unit))
    if not interleaved:
        gate, up = gate_up[:, :width], gate_up[:, width:]
        args = (alpha, offset, limit)
        assert_close(composite.gated_unit_pair(gate, up, *args), native.gated_unit_pair(gate, up, *args))
        for got, want in zip(composite.gated_unit_pair_backward(grad, gate, up, *args),
                             native.gated_unit_pair_backward(grad, gate, up, *args)):
            assert_close(got, want)


def test_gated_unit_composite_backward_is_the_gradient_of_its_forward():
    g = torch.Generator().manual_seed(5)
    for unit in UNITS:
        gate_up = (torch.randn(6, 10, generator=g, dtype=torch.float64) * 3).requires_grad_()
        grad = torch.randn(6, 5, generator=g, dtype=torch.float64)
        gate_up_values = gate_up.detach()
        keep = (gate_up_values.abs() - 7).abs() > 1e-3  # away from the clamp's kinks
        (composite.gated_unit(gate_up, *unit) * grad).sum().backward()
        d = composite.gated_unit_backward(grad, gate_up_values, *unit)
        torch.testing.assert_close(d[keep], gate_up.grad[keep])


def test_the_self_check_passes_for_the_cpu_operators_and_catches_a_uniform_shift():
    operators = ("group_by_expert", "gated_unit", "gated_unit_backward", "gated_unit_pair",
                 "gated_unit_pair_backward")
    assert compare_operators(native, composite, CPU, operators=operators) == {name: None for name in operators}

    class Shifted:
        group_by_expert = staticmethod(native.group_by_expert)
        gated_unit_backward = staticmethod(native.gated_unit_backward)
        gated_unit_pair = staticmethod(native.gated_unit_pair)
        gated_unit_pair_backward = staticmethod(native.gated_unit_pair_backward)

        @staticmethod
        def gated_unit(*args):
            h = native.gated_unit(*args)
            return torch.nextafter(h, torch.full_like(h, float("inf")))

    failures = compare_operators(Shifted, composite, CPU, operators=operators)
    assert failures["gated_unit"] is not None and "differ" in failures["gated_unit"]
    assert all(failures[name] is None for name in operators if name != "gated_unit")


@pytest.mark.skipif(not cuda_available, reason="needs a CUDA device")
@pytest.mark.parametrize("tokens,k,experts", [(0, 2, 3), (1, 1, 1), (37, 2, 5), (3001, 8, 257), (100, 3, 9000)])
def test_group_by_expert_cuda_equals_cpu(tokens, k, experts):
    g = torch.Generator().manual_seed(tokens + k + experts)
    for dtype in (torch.int32, torch.int64, torch.int16):
        ids = random_ids(tokens, k, experts, torch.int64, g).to(dtype)
        for view in (ids, ids.t().contiguous().t()):
            want = native.group_by_expert(view, experts)
            got = native.group_by_expert(view.cuda(), experts)
            for w, r in zip(want, got):
                assert r.is_cuda and torch.equal(w, r.cpu())


@pytest.mark.skipif(not cuda_available, reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("unit", UNITS)
def test_gated_units_cuda_match_cpu(dtype, unit):
    g = torch.Generator().manual_seed(3)
    alpha, offset, limit, interleaved = unit
    for rows, width in ((0, 4), (1, 1), (37, 19), (513, 300)):
        gate_up = unit_values(rows, 2 * width, dtype, g)
        grad = unit_values(rows, width, dtype, g)
        on_gpu = gate_up.cuda()
        assert_close(native.gated_unit(on_gpu, *unit).cpu(), native.gated_unit(gate_up, *unit))
        assert_close(native.gated_unit_backward(grad.cuda(), on_gpu, *unit).cpu(),
                     native.gated_unit_backward(grad, gate_up, *unit))
        if not interleaved:
            args = (alpha, offset, limit)
            gate, up = gate_up[:, :width], gate_up[:, width:]
            assert_close(native.gated_unit_pair(gate.cuda(), up.cuda(), *args).cpu(),
                         native.gated_unit_pair(gate, up, *args))
            for got, want in zip(native.gated_unit_pair_backward(grad.cuda(), gate.cuda(), up.cuda(), *args),
                                 native.gated_unit_pair_backward(grad, gate, up, *args)):
                assert_close(got.cpu(), want)


@pytest.mark.skipif(not cuda_available, reason="needs a CUDA device")
def test_cuda_operators_capture_in_a_graph_and_reject_bad_arguments():
    ids = torch.randint(-1, 9, (64, 2), device="cuda")
    gate_up = torch.randn(64, 32, device="cuda")
    native.group_by_expert(ids, 8), native.gated_unit(gate_up, 1.0, 0.0, None, False)  # compile first
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # fails if either synchronises with the host
        grouped = native.group_by_expert(ids, 8)
        h = native.gated_unit(gate_up, 1.0, 0.0, None, False)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(grouped[0].cpu(), native.group_by_expert(ids.cpu(), 8)[0])
    assert h.shape == (64, 16)
    with pytest.raises(ValueError, match="num_experts"):
        native.group_by_expert(ids, 0)
    with pytest.raises(TypeError, match="integers"):
        native.group_by_expert(ids.float(), 8)
    with pytest.raises(ValueError, match="even number of columns"):
        native.gated_unit(torch.randn(4, 5, device="cuda"), 1.0, 0.0, None, False)
    with pytest.raises(ValueError, match="limit"):
        native.gated_unit(gate_up, 1.0, 0.0, -1.0, False)
