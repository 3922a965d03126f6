"""tutel.ops.expert_linear (batched [E, C, K] and grouped [N, K] layouts) against float64
per-expert products: forward, every gradient, gradcheck, the Python fallback and bad input."""
import pytest
import torch

from conftest import tolerance
from tutel.ops import expert_linear
from tutel.ops.linear import grouped_linear_backward_loop, grouped_linear_loop


def reference_grouped(x, weight, bias, group_rows, weight_transposed):
    """float64 y rows of each expert, one expert at a time."""
    outputs, offset = [], 0
    for expert, count in enumerate(group_rows):
        w = weight[expert].t() if weight_transposed else weight[expert]
        y = x[offset:offset + count] @ w
        outputs.append(y + bias[expert] if bias is not None else y)
        offset += count
    return torch.cat(outputs, dim=0)


def make_weights(experts, inputs, outputs, weight_transposed, with_bias, dtype):
    shape = (experts, outputs, inputs) if weight_transposed else (experts, inputs, outputs)
    weight = torch.randn(shape, dtype=dtype).requires_grad_()
    bias = torch.randn(experts, outputs, dtype=dtype).requires_grad_() if with_bias else None
    return weight, bias


def leaves_as_float64(*tensors):
    return [None if t is None else t.detach().double().requires_grad_() for t in tensors]


def compare_with_reference(x, weight, bias, group_rows, weight_transposed, dtype):
    y = expert_linear(x, weight, bias, weight_transposed=weight_transposed, group_rows=group_rows)
    upstream = torch.randn(y.shape, dtype=torch.float64)
    (y.double() * upstream).sum().backward()
    x64, w64, b64 = leaves_as_float64(x, weight, bias)
    flat_rows = group_rows if group_rows is not None else [x.shape[1]] * x.shape[0]
    flat_x64 = x64.reshape(-1, x64.shape[-1])
    y64 = reference_grouped(flat_x64, w64, b64, flat_rows, weight_transposed).reshape(y.shape)
    (y64 * upstream).sum().backward()
    tol = tolerance(dtype) if dtype != torch.bfloat16 else dict(rtol=3e-2, atol=3e-2 * x.shape[-1] ** 0.5)
    torch.testing.assert_close(y.double(), y64.detach(), **tol)
    for got, expected in ((x, x64), (weight, w64), (bias, b64)):
        if got is not None:
            torch.testing.assert_close(got.grad.double(), expected.grad, **tol)


@pytest.mark.parametrize("grouped", [False, True])
def test_bfloat16_widened_without_autograd_matches_reference(no_native_16bit, grouped):
    """40 rows per expert: the product runs in float32 with the operands widened into reused
    buffers (no autograd), and still equals the float64 reference to bfloat16's rounding."""
    experts, rows, inputs, outputs = 3, 40, 24, 10
    x = torch.randn(experts * rows, inputs).bfloat16() if grouped else torch.randn(experts, rows, inputs).bfloat16()
    weight, bias = make_weights(experts, inputs, outputs, False, True, torch.bfloat16)
    group_rows = [rows] * experts if grouped else None
    with torch.no_grad():
        y = expert_linear(x, weight, bias, group_rows=group_rows)
    x64, w64, b64 = (t.detach().double() for t in (x, weight, bias))
    y64 = reference_grouped(x64.reshape(-1, inputs), w64, b64, [rows] * experts, False).reshape(y.shape)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.double(), y64, **tolerance(torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("weight_transposed", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("experts,capacity,inputs,outputs", [(1, 5, 3, 4), (4, 7, 10, 6), (3, 0, 5, 2), (6, 13, 100, 17)])
def test_batched_matches_reference(dtype, weight_transposed, with_bias, experts, capacity, inputs, outputs):
    x = torch.randn(experts, capacity, inputs, dtype=dtype).requires_grad_()
    weight, bias = make_weights(experts, inputs, outputs, weight_transposed, with_bias, dtype)
    compare_with_reference(x, weight, bias, None, weight_transposed, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("weight_transposed", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("group_rows", [[5], [3, 0, 4], [0, 0, 0], [40, 1, 2, 0, 7, 3, 1, 9], [0, 11]])
def test_grouped_matches_reference(dtype, weight_transposed, with_bias, group_rows):
    inputs, outputs = 9, 6
    x = torch.randn(sum(group_rows), inputs, dtype=dtype).requires_grad_()
    weight, bias = make_weights(len(group_rows), inputs, outputs, weight_transposed, with_bias, dtype)
    compare_with_reference(x, weight, bias, group_rows, weight_transposed, dtype)


def test_empty_group_gets_zero_weight_and_bias_gradient():
    weight, bias = make_weights(3, 4, 5, False, True, torch.float64)
    weight.grad = None
    x = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    expert_linear(x, weight, bias, group_rows=[2, 0, 4]).sum().backward()
    assert torch.count_nonzero(weight.grad[1]) == 0 and torch.count_nonzero(bias.grad[1]) == 0
    assert torch.count_nonzero(weight.grad[0]) > 0


@pytest.mark.parametrize("weight_transposed", [False, True])
def test_gradcheck_float64(weight_transposed):
    weight, bias = make_weights(3, 4, 3, weight_transposed, True, torch.float64)
    grouped_x = torch.randn(7, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda x, w, b: expert_linear(x, w, b, weight_transposed=weight_transposed, group_rows=[3, 0, 4]),
        (grouped_x, weight, bias))
    batched_x = torch.randn(3, 2, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda x, w, b: expert_linear(x, w, b, weight_transposed=weight_transposed), (batched_x, weight, bias))
    assert torch.autograd.gradgradcheck(
        lambda x, w, b: expert_linear(x, w, b, weight_transposed=weight_transposed), (batched_x, weight, bias))


@pytest.mark.parametrize("weight_transposed", [False, True])
def test_python_loop_equals_compiled_operator(weight_transposed):
    """The loop other devices run gives the operator's results (checked here on CPU)."""
    group_rows = [4, 0, 9, 1]
    x = torch.randn(sum(group_rows), 6)
    weight, bias = make_weights(4, 6, 5, weight_transposed, True, torch.float32)
    grad = torch.randn(sum(group_rows), 5)
    with torch.no_grad():
        expected = torch.ops.tutel.grouped_linear(x, weight, bias, group_rows, weight_transposed)
        torch.testing.assert_close(grouped_linear_loop(x, weight, bias, group_rows, weight_transposed), expected)
        for mask in ([True, True, True], [False, True, False], [True, False, False]):
            compiled = torch.ops.tutel.grouped_linear_backward(grad, x, weight, group_rows, weight_transposed, mask)
            loop = grouped_linear_backward_loop(grad, x, weight, group_rows, weight_transposed, mask)
            for wanted, got, want in zip(mask, loop, compiled):
                if wanted:
                    torch.testing.assert_close(got, want)
                else:
                    assert got is None and want.numel() == 0


# Few rows per expert, and enough that a CPU without 16-bit dot products multiplies in float32
# (tutel.ops.precision): that path must not be cast back to 16 bits by autocast.
@pytest.mark.parametrize("group_rows,capacity", [(None, 8), ([3, 0, 5], None), (None, 40), ([40, 0, 70], None)])
def test_autocast_runs_the_product_in_bfloat16_and_adds_the_float32_bias(group_rows, capacity):
    """As matmul(x, w) + b does under autocast: bfloat16 product, float32 bias, float32 result."""
    weight, bias = make_weights(3, 6, 4, True, True, torch.float32)
    x = torch.randn(3, capacity, 6) if group_rows is None else torch.randn(sum(group_rows), 6)
    x.requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = expert_linear(x, weight, bias, weight_transposed=True, group_rows=group_rows)
    assert y.dtype == torch.float32
    y.backward(torch.ones_like(y))
    assert x.grad.dtype == weight.grad.dtype == bias.grad.dtype == torch.float32
    rows = group_rows or [capacity] * 3
    x64, w64, b64 = leaves_as_float64(x, weight, bias)
    expected = reference_grouped(x64.reshape(-1, 6), w64, b64, rows, True).reshape(y.shape)
    expected.backward(torch.ones_like(expected))
    torch.testing.assert_close(y.double(), expected.detach(), rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(bias.grad.double(), b64.grad)  # the bias gradient is exact: sums of ones
    torch.testing.assert_close(weight.grad.double(), w64.grad, rtol=3e-2, atol=1e-1)


def test_non_cpu_device_takes_the_loop():
    """On a device without the compiled operator (here: meta) the loop runs; shapes are right."""
    weight = torch.empty(3, 5, 4, device="meta", requires_grad=True)
    x = torch.empty(6, 4, device="meta", requires_grad=True)
    y = expert_linear(x, weight, None, weight_transposed=True, group_rows=[1, 2, 3])
    assert y.shape == (6, 5) and y.device.type == "meta"
    y.backward(torch.empty(6, 5, device="meta"))
    assert x.grad.shape == x.shape and weight.grad.shape == weight.shape


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("group_rows", [None, [5, 0, 2]])
def test_cuda_matches_cpu(group_rows):
    weight, bias = make_weights(3, 4, 6, True, True, torch.float64)
    x = (torch.randn(3, 7, 4) if group_rows is None else torch.randn(7, 4)).double().requires_grad_()
    grad = torch.randn(x.shape[:-1] + (6,), dtype=torch.float64)
    expected = expert_linear(x, weight, bias, weight_transposed=True, group_rows=group_rows)
    expected.backward(grad)
    on_gpu = [t.detach().cuda().requires_grad_() for t in (x, weight, bias)]
    got = expert_linear(*on_gpu, weight_transposed=True, group_rows=group_rows)
    got.backward(grad.cuda())
    torch.testing.assert_close(got.cpu(), expected)
    for gpu, cpu in zip(on_gpu, (x, weight, bias)):
        torch.testing.assert_close(gpu.grad.cpu(), cpu.grad)


def test_fake_tensor_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        x, weight = torch.empty(7, 4), torch.empty(2, 4, 3)
        assert torch.ops.tutel.grouped_linear(x, weight, None, [3, 4], False).shape == (7, 3)
        gx, gw, gb = torch.ops.tutel.grouped_linear_backward(torch.empty(7, 3), x, weight, [3, 4], False,
                                                             [True, True, False])
        assert gx.shape == (7, 4) and gw.shape == (2, 4, 3) and gb.numel() == 0


@pytest.mark.parametrize("call,match", [
    (lambda: expert_linear(torch.randn(5, 3), torch.randn(2, 3, 4), group_rows=[2, 2]), "group_rows"),
    (lambda: expert_linear(torch.randn(5, 3), torch.randn(2, 3, 4), group_rows=[6, -1]), "group_rows"),
    (lambda: expert_linear(torch.randn(5, 3), torch.randn(2, 3, 4), group_rows=[5]), "group_rows"),
    (lambda: expert_linear(torch.randn(3, 5, 3), torch.randn(2, 3, 4)), "experts"),
    (lambda: expert_linear(torch.randn(5, 3), torch.randn(3, 4)), "weight"),
    (lambda: torch.ops.tutel.grouped_linear(torch.randn(5, 3), torch.randn(2, 3, 4), None, [4, 2], False),
     "group_rows"),
    (lambda: torch.ops.tutel.grouped_linear(torch.randn(5, 3), torch.randn(2, 3, 4), None, [6, -1], False),
     "negative"),
    (lambda: torch.ops.tutel.grouped_linear(torch.randn(5, 2), torch.randn(2, 3, 4), None, [2, 3], False),
     "features"),
    (lambda: torch.ops.tutel.grouped_linear(torch.randn(5, 3), torch.randn(2, 3, 4), torch.randn(2, 5), [2, 3],
                                            False), "bias"),
])
def test_bad_input_raises_value_error(call, match):
    with pytest.raises(ValueError, match=match):
        call()
