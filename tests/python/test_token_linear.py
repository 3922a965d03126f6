"""tutel.ops.linear.token_linear (a router's logits) against float64 F.linear: the grouped-operator
path (16-bit rows on the CPU without autograd, up to TOKEN_LINEAR_MAX_ROWS), F.linear everywhere
else, and the top gate that uses it."""
import pytest
import torch
import torch.nn.functional as F

from conftest import tolerance
from tutel.gates.top import LinearTopKGate
from tutel.ops import linear as linear_module
from tutel.ops.linear import TOKEN_LINEAR_MAX_ROWS, token_linear


def reference(x, weight, bias):
    return F.linear(x.double(), weight.double(), None if bias is None else bias.double())


def assert_close_to_reference(y, x, weight, bias):
    expected = reference(x, weight, bias)
    assert y.dtype == x.dtype and y.shape == expected.shape
    rtol, atol = tolerance(x.dtype)["rtol"], tolerance(x.dtype)["atol"]
    scale = expected.abs().max().item() if expected.numel() else 1.0
    torch.testing.assert_close(y.double(), expected, rtol=rtol, atol=atol * max(1.0, scale))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens", [0, 1, 3, 7, TOKEN_LINEAR_MAX_ROWS])
@pytest.mark.parametrize("inputs,outputs", [(33, 8), (100, 64), (17, 1)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_small_16bit_batches_match_float64(dtype, tokens, inputs, outputs, with_bias):
    torch.manual_seed(tokens * 7 + inputs)
    x = torch.randn(tokens, inputs, dtype=dtype)
    weight = torch.randn(outputs, inputs, dtype=dtype) / inputs ** 0.5
    bias = torch.randn(outputs, dtype=dtype) if with_bias else None
    with torch.no_grad():
        assert_close_to_reference(token_linear(x, weight, bias), x, weight, bias)


def test_grouped_operator_serves_exactly_the_small_16bit_no_grad_calls():
    calls = []
    real = linear_module.F.linear

    def counting_linear(*args):
        calls.append("F.linear")
        return real(*args)

    x = torch.randn(TOKEN_LINEAR_MAX_ROWS + 1, 24, dtype=torch.bfloat16)
    weight = torch.randn(8, 24, dtype=torch.bfloat16)
    linear_module.F.linear = counting_linear
    try:
        with torch.no_grad():
            token_linear(x[:TOKEN_LINEAR_MAX_ROWS], weight)  # the operator
            token_linear(x, weight)  # one row past the line: F.linear
            token_linear(x[:2].float(), weight.float())  # float32: F.linear
        token_linear(x[:2], weight.requires_grad_())  # autograd: F.linear
    finally:
        linear_module.F.linear = real
    assert calls == ["F.linear"] * 3


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gradients_flow_through_f_linear(dtype):
    torch.manual_seed(1)
    x = torch.randn(5, 40, dtype=dtype, requires_grad=True)
    weight = torch.randn(12, 40, dtype=dtype, requires_grad=True)
    bias = torch.randn(12, dtype=dtype, requires_grad=True)
    y = token_linear(x, weight, bias)
    upstream = torch.randn(y.shape, dtype=torch.float64)
    (y.double() * upstream).sum().backward()
    x64, w64, b64 = (t.detach().double().requires_grad_() for t in (x, weight, bias))
    (F.linear(x64, w64, b64) * upstream).sum().backward()
    rtol, atol = tolerance(dtype)["rtol"], tolerance(dtype)["atol"]
    for got, want in ((x.grad, x64.grad), (weight.grad, w64.grad), (bias.grad, b64.grad)):
        torch.testing.assert_close(got.double(), want, rtol=rtol, atol=atol * max(1.0, want.abs().max().item()))


def test_autocast_keeps_f_linear():
    x = torch.randn(2, 16, dtype=torch.bfloat16)
    weight = torch.randn(4, 16)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        y = token_linear(x, weight.to(torch.bfloat16))
        expected = F.linear(x, weight.to(torch.bfloat16))
    assert y.dtype == expected.dtype
    torch.testing.assert_close(y, expected)


@pytest.mark.parametrize("router_bias", [False, True])
@pytest.mark.parametrize("tokens", [1, 4])
def test_top_gate_logits_in_bfloat16(router_bias, tokens):
    torch.manual_seed(3)
    gate = LinearTopKGate(48, 10, k=2, router_bias=router_bias).to(torch.bfloat16)
    with torch.no_grad():
        if router_bias:
            gate.wg.bias.normal_()  # nn.Linear's bias starts small; give it values the test can see
        x = torch.randn(tokens, 48, dtype=torch.bfloat16)
        assert_close_to_reference(gate(x), x, gate.wg.weight, gate.wg.bias)
