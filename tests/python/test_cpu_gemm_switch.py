"""TUTEL_CPU_GEMM / tutel.ops.cpu_gemm: with ``"torch"`` every CPU expert product runs PyTorch's GEMM.

The products under the switch against float64 references: the grouped operator's forward and every
gradient, routed_experts (with autograd and in its one-call inference), and moe_layer's grouped
experts forward and backward, in every dtype, with group sizes that tutel's CPU GEMM would give to
its skinny products (1-6 and 7-32 rows), to its tile products where the CPU has AMX (bfloat16, up to
256 rows) and to PyTorch's GEMM (past those), odd feature counts.  Then what shows that the switch
changes the implementation: the profiler sees one aten::mm / aten::addmm per group under "torch" and
none for skinny groups under "tutel"; and the variable's handling (read at the first product, bad
values named, the context manager restoring the choice).
"""
import os
import subprocess
import sys

import pytest
import torch

import tutel  # noqa: F401  (loads the operators)
from layer_harness import run_and_compare as run_layer_and_compare
from test_routed_experts import make_case, run_and_compare, run_without_grad
from tutel import moe
from tutel.ops import expert_linear
from tutel.ops.cpu_gemm import CPU_GEMMS, cpu_gemm, set_cpu_gemm, using_cpu_gemm

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Rounding of one result in each dtype; sums run in float32 (float64 for float64).
UNIT_ROUNDING = {torch.float64: 2.0 ** -53, torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8,
                 torch.float16: 2.0 ** -11}
ACCUMULATION = {torch.float64: 2.0 ** -53}
# Groups around every line: 0, 1-6 (skinny everywhere), 7-32 (skinny on AVX2 / AVX-512 float32),
# 33-300 (tiles for bfloat16 up to 256 with AMX, else the GEMM).
GROUPS = [0, 1, 3, 6, 7, 19, 32, 33, 64, 257, 300, 2]


@pytest.fixture(autouse=True)
def _torch_gemm():
    with using_cpu_gemm("torch"):
        yield


def reference(x, weight, bias, group_rows, outputs_by_inner):
    """float64 rows of each group times its matrix (transposed for [O, K]) plus its bias."""
    pieces, start = [], 0
    for g, count in enumerate(group_rows):
        w = weight[g].double()
        y = x[start:start + count].double() @ (w.t() if outputs_by_inner else w)
        pieces.append(y if bias is None else y + bias[g].double())
        start += count
    return torch.cat(pieces)


def assert_within_rounding(got, expected, scale, inner, dtype):
    """|got - expected| within the dtype's rounding of the result (half the subnormals' spacing where
    it underflows) plus an accumulation over `inner` terms of size `scale` (sum |x_k w_k|)."""
    accumulation = ACCUMULATION.get(dtype, 2.0 ** -24)
    underflow = 0.5 * torch.finfo(dtype).smallest_normal * torch.finfo(dtype).eps
    bound = UNIT_ROUNDING[dtype] * expected.abs() + (inner + 2) * accumulation * scale + underflow
    error = (got.double() - expected).abs()
    assert got.dtype == dtype and got.shape == expected.shape
    assert torch.all(error <= bound), f"max error {error.max().item():.3e}, worst ratio {(error / bound).max():.2f}"


def operands(groups, inner, outputs, outputs_by_inner, with_bias, dtype, seed):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(groups), inner, generator=generator, dtype=torch.float64).to(dtype)
    shape = (len(groups), outputs, inner) if outputs_by_inner else (len(groups), inner, outputs)
    weight = torch.randn(shape, generator=generator, dtype=torch.float64).to(dtype)
    bias = torch.randn(len(groups), outputs, generator=generator, dtype=torch.float64).to(dtype) if with_bias else None
    return x, weight, bias


DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("outputs_by_inner", [True, False])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("inner,outputs", [(37, 29), (64, 130)])
def test_grouped_operator_forward(dtype, outputs_by_inner, with_bias, inner, outputs):
    x, weight, bias = operands(GROUPS, inner, outputs, outputs_by_inner, with_bias, dtype, inner + outputs)
    got = torch.ops.tutel.grouped_linear(x, weight, bias, GROUPS, outputs_by_inner)
    magnitude = reference(x.abs(), weight.abs(), None if bias is None else bias.abs(), GROUPS, outputs_by_inner)
    assert_within_rounding(got, reference(x, weight, bias, GROUPS, outputs_by_inner), magnitude, inner, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("outputs_by_inner", [True, False])
def test_grouped_operator_gradients(dtype, outputs_by_inner):
    """d x, d W (in W's layout) and d b of the operator's backward against float64 autograd."""
    inner, outputs = 23, 41
    x, weight, bias = operands(GROUPS, inner, outputs, outputs_by_inner, True, dtype, 5)
    grad = torch.randn(sum(GROUPS), outputs, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    grad = grad.to(dtype)
    got_x, got_w, got_b = torch.ops.tutel.grouped_linear_backward(grad, x, weight, GROUPS, outputs_by_inner,
                                                                  [True, True, True])
    leaves = [t.double().requires_grad_() for t in (x, weight, bias)]
    want_x, want_w, want_b = torch.autograd.grad(reference(*leaves, GROUPS, outputs_by_inner), leaves, grad.double())
    # Each gradient's magnitude: the same products over |operands|.
    abs_leaves = [t.double().abs().requires_grad_() for t in (x, weight, bias)]
    scale_x, scale_w, scale_b = torch.autograd.grad(reference(*abs_leaves, GROUPS, outputs_by_inner), abs_leaves,
                                                    grad.double().abs())
    assert_within_rounding(got_x, want_x, scale_x, outputs, dtype)
    assert_within_rounding(got_w, want_w, scale_w, max(GROUPS), dtype)
    assert_within_rounding(got_b, want_b, scale_b, max(GROUPS), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_expert_linear_autograd(dtype):
    """The autograd path of the grouped layout (tutel.ops.expert_linear) under the switch."""
    groups, inner, outputs = [5, 0, 31, 70], 19, 27
    x, weight, bias = operands(groups, inner, outputs, False, True, dtype, 9)
    leaves = [t.requires_grad_() for t in (x, weight, bias)]
    y = expert_linear(*leaves, group_rows=groups)
    grad = torch.randn(y.shape, generator=torch.Generator().manual_seed(10), dtype=torch.float64)
    got = torch.autograd.grad(y, leaves, grad.to(dtype))
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    ref = reference(*ref_leaves, groups, False)
    want = torch.autograd.grad(ref, ref_leaves, grad)
    tolerance = {torch.float64: 1e-10, torch.float32: 2e-5, torch.bfloat16: 4e-2, torch.float16: 4e-3}[dtype]
    torch.testing.assert_close(y.double(), ref, rtol=tolerance, atol=tolerance * 4)
    for g, w in zip(got, want):
        torch.testing.assert_close(g.double(), w, rtol=tolerance, atol=tolerance * 4 * float(w.abs().max()))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("tokens,experts,k", [(3, 4, 2), (29, 5, 3), (233, 3, 2)])
def test_routed_experts_with_autograd(dtype, transposed, tokens, experts, k):
    """routed_experts' values and every gradient; 1-2, ~17 and ~155 rows per expert."""
    case = make_case(tokens, 21, 9, 13, experts, k, True, transposed, True, True, dtype, seed=tokens)
    run_and_compare(case, transposed, True, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("tokens", [1, 11, 150])
def test_routed_experts_one_call_inference(dtype, transposed, tokens):
    """The one-call operator (routed_gated_experts) runs its products through the same switch."""
    case = make_case(tokens, 19, 7, 11, 3, 2, True, transposed, True, True, dtype, seed=tokens + 1)
    run_without_grad(tuple(t.detach() if t is not None and t.is_floating_point() else t for t in case),
                     transposed, dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("tokens", [7, 190])
def test_moe_layer_forward_and_backward(dtype, tokens):
    """moe_layer's grouped ffn experts (dropless, megablocks_size=1): output, l_aux and every
    gradient against the token-by-token float64 reference."""
    layer = moe.moe_layer(gate_type={"type": "top", "k": 2, "capacity_factor": 0.0}, model_dim=10,
                          experts={"type": "ffn", "num_experts_per_device": 3, "hidden_size_per_expert": 13})
    layer = layer.to(dtype)
    x = torch.randn(tokens, 10, dtype=torch.float64).to(dtype)
    tol = dict(rtol=1e-10, atol=1e-10) if dtype == torch.float64 else dict(rtol=1e-4, atol=1e-4)
    run_layer_and_compare(layer, x, forward_kwargs=dict(megablocks_size=1), top_k=2, capacity_factor=0.0, tol=tol,
                          use_layer_logits=dtype != torch.float64)


def profiled_ops(fn):
    """How many times each aten::mm / aten::addmm ran inside fn()."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        fn()
    counts = {event.key: event.count for event in profile.key_averages()}
    return counts.get("aten::mm", 0), counts.get("aten::addmm", 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_switch_changes_the_products(dtype):
    """Groups of 1-3 rows: tutel's skinny products under "tutel" (no aten::mm at all), one PyTorch
    GEMM per non-empty group under "torch", forward (addmm with a bias) and backward (d x and d W)."""
    groups, inner, outputs = [3, 1, 0, 2], 16, 24
    x, weight, bias = operands(groups, inner, outputs, True, True, dtype, 3)
    grad = torch.randn(sum(groups), outputs).to(dtype)

    def forward():
        torch.ops.tutel.grouped_linear(x, weight, bias, groups, True)

    def backward():
        torch.ops.tutel.grouped_linear_backward(grad, x, weight, groups, True, [True, True, False])

    with using_cpu_gemm("tutel"):
        assert profiled_ops(forward) == (0, 0)
        assert profiled_ops(backward) == (3, 0)  # d W: always PyTorch's GEMM; d x: the skinny products
    assert profiled_ops(forward) == (0, 3)
    assert profiled_ops(backward) == (6, 0)


def test_switch_reaches_the_one_call_operator():
    x, ids, weights, up, down, up_bias, down_bias = (t.detach() if t.is_floating_point() else t for t in
                                                     make_case(2, 16, 8, 12, 4, 1, True, False, True, False,
                                                               torch.float32, seed=2))
    from tutel.experts import routed_experts

    def call():
        with torch.no_grad():
            routed_experts(x, ids, weights, up, down, up_bias=up_bias, down_bias=down_bias, gate="swiglu")

    with using_cpu_gemm("tutel"):
        assert profiled_ops(call) == (0, 0)
    used = torch.unique(ids).numel()
    assert profiled_ops(call) == (0, 2 * used)  # up and down, each with its bias


def test_set_and_restore():
    assert cpu_gemm() == "torch"
    with using_cpu_gemm("tutel"):
        assert cpu_gemm() == "tutel"
        set_cpu_gemm(" TORCH ")  # case and blanks do not matter
        assert cpu_gemm() == "torch"
    assert cpu_gemm() == "torch"
    with pytest.raises(RuntimeError):
        with using_cpu_gemm("tutel"):
            raise RuntimeError("the block failed")
    assert cpu_gemm() == "torch"
    assert CPU_GEMMS == ("tutel", "torch")


@pytest.mark.parametrize("bad", ["mkl", "torch2", "1"])
def test_bad_names_are_refused(bad):
    with pytest.raises(ValueError, match="'tutel'.*'torch'") as error:
        set_cpu_gemm(bad)
    assert repr(bad) in str(error.value) and "set_cpu_gemm" in str(error.value)
    assert cpu_gemm() == "torch"  # unchanged
    with pytest.raises(TypeError, match="set_cpu_gemm"):
        set_cpu_gemm(1)


def run_with_variable(value, script):
    env = dict(os.environ, TUTEL_CPU_GEMM=value, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)


PRODUCT = ("import torch, tutel\n"
           "x, w = torch.randn(3, 8), torch.randn(2, 5, 8)\n"
           "with torch.profiler.profile() as p:\n"
           "    torch.ops.tutel.grouped_linear(x, w, None, [1, 2], True)\n"
           "print(sum(e.count for e in p.key_averages() if e.key == 'aten::mm'))\n"
           "from tutel.ops.cpu_gemm import cpu_gemm\n"
           "print(cpu_gemm())\n")


@pytest.mark.parametrize("value,mm_calls", [("torch", 2), (" Torch", 2), ("tutel", 0), ("", 0)])
def test_variable_sets_the_choice(value, mm_calls):
    done = run_with_variable(value, PRODUCT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(mm_calls), "torch" if mm_calls else "tutel"]


def test_bad_variable_is_named_at_the_first_product():
    done = run_with_variable("cublas", "import torch, tutel\n"
                                       "torch.ops.tutel.grouped_linear(torch.randn(3, 8), torch.randn(2, 5, 8), None, "
                                       "[1, 2], True)\n")
    assert done.returncode != 0
    assert "ValueError" in done.stderr and "TUTEL_CPU_GEMM = 'cublas'" in done.stderr
    assert "'tutel'" in done.stderr and "'torch'" in done.stderr
    # A choice made in the process replaces the variable's.
    done = run_with_variable("cublas", "from tutel.ops.cpu_gemm import set_cpu_gemm, cpu_gemm\n"
                                       "set_cpu_gemm('torch')\nprint(cpu_gemm())\n")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["torch"]
