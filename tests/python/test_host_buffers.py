"""The CPU buffer cache (tutel.ops.host_buffers): every operator whose output comes from it
gives the right values when it gets a reused block full of NaNs (an operator relying on
fresh, zeroed pages would pass without the cache and fail here), outputs stay ordinary
resizable tensors, the limit and release work, bad limits are refused."""
import math
import os
import subprocess
import sys

import pytest
import torch

import tutel  # noqa: F401  (loads the operators)
from tutel.ops.host_buffers import cached_buffer_stats, release_cached_buffers, set_cached_buffer_limit

MIB = 1 << 20


@pytest.fixture(autouse=True)
def fresh_cache():
    limit = cached_buffer_stats()["limit_bytes"]
    release_cached_buffers()
    set_cached_buffer_limit(1 << 30)
    yield
    set_cached_buffer_limit(limit)
    release_cached_buffers()


def run_on_poisoned_block(op):
    """Runs `op` once, fills its (first) output with NaN and frees it, then runs it again: the
    second run gets the poisoned block back.  Returns the second run's outputs."""
    first = op()
    first = first if isinstance(first, (tuple, list)) else (first,)
    assert first[0].numel() * first[0].element_size() >= MIB, "the test's output must be large enough to be cached"
    for t in first:
        if t.is_floating_point():
            t.fill_(math.nan)
    del t
    hits = cached_buffer_stats()["hits"]
    del first
    second = op()
    assert cached_buffer_stats()["hits"] > hits, "the second run did not reuse a cached block"
    return second


def routing(gen, tokens, k, experts, capacity):
    indices = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(tokens)], dim=1).to(torch.int32)
    locations = torch.randint(0, capacity + 40, (k, tokens), generator=gen, dtype=torch.int32)  # some dropped
    weights = torch.rand(k, tokens, generator=gen)
    return indices, locations, weights


def test_scatter_slots_writes_every_slot_of_a_reused_block():
    gen = torch.Generator().manual_seed(1)
    tokens, k, experts, capacity, dim = 300, 2, 5, 300, 263
    src = torch.randn(tokens, dim, generator=gen)
    indices, locations, weights = routing(gen, tokens, k, experts, capacity)
    # Unique slots: keep the first claim of each (expert, slot); later claims are dropped.
    seen = set()
    for t in range(tokens):
        for j in range(k):
            key = (int(indices[j, t]), int(locations[j, t]))
            if key in seen:
                locations[j, t] = capacity + 1
            seen.add(key)
    out, _ = run_on_poisoned_block(lambda: torch.ops.tutel.scatter_slots(src, indices, locations, weights, None,
                                                                        experts, capacity))
    want = torch.zeros(experts, capacity, dim, dtype=torch.float64)
    for t in range(tokens):
        for j in range(k):
            if locations[j, t] < capacity:
                want[indices[j, t], locations[j, t]] = weights[j, t].double() * src[t].double()
    torch.testing.assert_close(out.double(), want, rtol=1e-6, atol=1e-6)


def test_gather_slots_on_a_reused_block():
    gen = torch.Generator().manual_seed(2)
    tokens, k, experts, capacity, dim = 1100, 2, 5, 300, 263
    rows = torch.randn(experts, capacity, dim, generator=gen)
    indices, locations, weights = routing(gen, tokens, k, experts, capacity)
    out, _ = run_on_poisoned_block(lambda: torch.ops.tutel.gather_slots(rows, indices, locations, weights, None))
    want = torch.zeros(tokens, dim, dtype=torch.float64)
    for t in range(tokens):
        for j in range(k):
            if locations[j, t] < capacity:
                want[t] += weights[j, t].double() * rows[indices[j, t], locations[j, t]].double()
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("weight_transposed", [False, True])
def test_grouped_linear_and_its_backward_on_reused_blocks(weight_transposed):
    gen = torch.Generator().manual_seed(3)
    counts, k_dim, o_dim = [600, 0, 7, 450], 263, 301  # an idle expert: a zero weight gradient
    x = torch.randn(sum(counts), k_dim, generator=gen)
    shape = (len(counts), o_dim, k_dim) if weight_transposed else (len(counts), k_dim, o_dim)
    weight = torch.randn(shape, generator=gen)
    grad = torch.randn(sum(counts), o_dim, generator=gen)
    out = run_on_poisoned_block(lambda: torch.ops.tutel.grouped_linear(x, weight, None, counts, weight_transposed))
    grads = run_on_poisoned_block(lambda: torch.ops.tutel.grouped_linear_backward(
        grad, x, weight, counts, weight_transposed, [True, True, False]))

    x64, w64 = x.double().requires_grad_(), weight.double().requires_grad_()
    pieces, start = [], 0
    for expert, count in enumerate(counts):
        right = w64[expert].t() if weight_transposed else w64[expert]
        pieces.append(x64[start:start + count] @ right)
        start += count
    want = torch.cat(pieces)
    want_x, want_w = torch.autograd.grad(want, (x64, w64), grad.double())
    torch.testing.assert_close(out.double(), want.detach(), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(grads[0].double(), want_x, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(grads[1].double(), want_w, rtol=1e-4, atol=1e-3)
    assert not grads[1][1].any()


@pytest.mark.parametrize("interleaved", [False, True])
def test_gated_unit_and_its_backward_on_reused_blocks(interleaved):
    gen = torch.Generator().manual_seed(4)
    gate_up = torch.randn(1031, 2 * 263, generator=gen)
    grad = torch.randn(1031, 263, generator=gen)
    out = run_on_poisoned_block(lambda: torch.ops.tutel.gated_unit(gate_up, 1.0, 0.0, None, interleaved))
    grad_in = run_on_poisoned_block(lambda: torch.ops.tutel.gated_unit_backward(grad, gate_up, 1.0, 0.0, None,
                                                                                interleaved))
    g64 = gate_up.double().requires_grad_()
    gate, up = (g64[:, 0::2], g64[:, 1::2]) if interleaved else g64.chunk(2, dim=1)
    want = torch.nn.functional.silu(gate) * up
    (want_grad,) = torch.autograd.grad(want, g64, grad.double())
    torch.testing.assert_close(out.double(), want.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad_in.double(), want_grad, rtol=1e-5, atol=1e-5)


def test_gated_unit_pair_and_its_backward_on_reused_blocks():
    gen = torch.Generator().manual_seed(5)
    gate, up, grad = (torch.randn(1031, 263, generator=gen) for _ in range(3))
    out = run_on_poisoned_block(lambda: torch.ops.tutel.gated_unit_pair(gate, up, 1.0, 0.0, None))
    grads = run_on_poisoned_block(lambda: torch.ops.tutel.gated_unit_pair_backward(grad, gate, up, 1.0, 0.0, None))
    g64, u64 = gate.double().requires_grad_(), up.double().requires_grad_()
    want = torch.nn.functional.silu(g64) * u64
    want_grads = torch.autograd.grad(want, (g64, u64), grad.double())
    torch.testing.assert_close(out.double(), want.detach(), rtol=1e-5, atol=1e-5)
    for got, expected in zip(grads, want_grads):
        torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
def test_select_rows_on_a_reused_block(index_dtype):
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(300, 263, generator=gen, dtype=torch.float64)
    index = torch.randint(0, 300, (1001,), generator=gen).to(index_dtype)
    out = run_on_poisoned_block(lambda: torch.ops.tutel.select_rows(x, index))
    want = torch.stack([x[int(i)] for i in index])
    assert torch.equal(out, want)
    assert torch.ops.tutel.select_rows(x, index[:0]).shape == (0, 263)


@pytest.mark.parametrize("source,target", [(torch.bfloat16, torch.float32), (torch.float16, torch.float32),
                                           (torch.float32, torch.bfloat16), (torch.float64, torch.float32)])
def test_to_dtype_on_a_reused_block(source, target):
    """Bit for bit what x.to(dtype) gives (also from a transposed view), contiguous, in a reused block."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(700, 1031, generator=gen, dtype=torch.float64).to(source)
    for view in (x, x.t()):
        out = run_on_poisoned_block(lambda: torch.ops.tutel.to_dtype(view, target))
        assert out.dtype == target and out.shape == view.shape and out.is_contiguous()
        assert torch.equal(out, view.to(target))
    assert torch.ops.tutel.to_dtype(x[:0], target).shape == (0, 1031)


@pytest.mark.parametrize("format, dtype, group", [("fp8_block", torch.bfloat16, 0), ("mxfp4", torch.float32, 0),
                                                   ("mxfp4", torch.float16, 0), ("fp8_block", torch.bfloat16, 128)])
def test_quantized_grouped_linear_on_a_reused_block(format, dtype, group):
    from tutel.ops.quantized_linear import quantized_grouped_linear
    from tutel.quant import Fp8BlockWeights, Mxfp4Weights
    from tutel.quant.activations import dynamic_activations
    gen = torch.Generator().manual_seed(9)
    weight = torch.randn(3, 520, 256, generator=gen, dtype=torch.float64)
    stack = Fp8BlockWeights.quantize(weight) if format == "fp8_block" else Mxfp4Weights.quantize(weight)
    x = torch.randn(1100, 256, generator=gen).to(dtype)
    ends = torch.tensor([400, 400, 1000])  # an empty expert, and 100 rows of none
    got = run_on_poisoned_block(lambda: quantized_grouped_linear(x, ends, stack, activation_group=group))
    rows = dynamic_activations(x, group, torch.float64) if group else x.double()
    dense = stack.dequantize_reference(torch.float64)
    want = torch.zeros(1100, 520, dtype=torch.float64)
    want[:400] = rows[:400] @ dense[0].t()
    want[400:1000] = rows[400:1000] @ dense[2].t()
    tolerance = 2 ** -7 if dtype == torch.bfloat16 else 2e-3
    torch.testing.assert_close(got.double(), want, rtol=tolerance, atol=tolerance * want.abs().max().item())
    assert not got[1000:].any()


def test_widened_converts_without_autograd_only():
    """tutel.ops.precision.widened: the cached conversion for eager tensors without autograd, the
    ordinary (differentiable) one otherwise, and the tensor itself when it has the dtype."""
    from tutel.ops.precision import widened
    x = torch.randn(600, 700).bfloat16()
    hits = cached_buffer_stats()["hits"]
    first = widened(x, torch.float32)
    del first
    again = widened(x, torch.float32)
    assert torch.equal(again, x.float()) and cached_buffer_stats()["hits"] > hits
    leaf = x.clone().requires_grad_()
    wide = widened(leaf, torch.float32)
    wide.sum().backward()
    assert leaf.grad is not None and torch.equal(leaf.grad, torch.ones_like(x))
    assert widened(x, torch.bfloat16) is x


def test_select_rows_refuses_bad_arguments():
    with pytest.raises(ValueError, match="index"):
        torch.ops.tutel.select_rows(torch.randn(4, 3), torch.tensor([0.0, 1.0]))
    with pytest.raises(ValueError, match="x"):
        torch.ops.tutel.select_rows(torch.randn(4), torch.tensor([0, 1]))
    with pytest.raises(IndexError, match="out of range"):
        torch.ops.tutel.select_rows(torch.randn(4, 3), torch.tensor([0, 4]))


def test_outputs_are_ordinary_resizable_tensors():
    x, weight = torch.randn(1024, 512), torch.randn(2, 512, 512)
    out = torch.ops.tutel.grouped_linear(x, weight, None, [512, 512], False)
    assert cached_buffer_stats()["live_bytes"] >= out.numel() * 4
    out.resize_(3000, 512)  # a new, larger block; the old one goes back
    out[2999] = 1.0
    assert out.shape == (3000, 512) and cached_buffer_stats()["cached_bytes"] >= 1024 * 512 * 4
    torch.testing.assert_close(out.clone()[2999], torch.ones(512))


def test_limit_zero_keeps_nothing_and_release_empties():
    x, weight = torch.randn(1024, 512), torch.randn(2, 512, 512)
    del_me = torch.ops.tutel.grouped_linear(x, weight, None, [512, 512], False)
    del del_me
    assert cached_buffer_stats()["cached_bytes"] >= 1024 * 512 * 4
    release_cached_buffers()
    assert cached_buffer_stats()["cached_bytes"] == 0
    set_cached_buffer_limit(0)
    before = cached_buffer_stats()
    out = torch.ops.tutel.grouped_linear(x, weight, None, [512, 512], False)
    after = cached_buffer_stats()
    assert after["misses"] == before["misses"] and after["live_bytes"] == before["live_bytes"]
    expected = torch.cat([x[:512] @ weight[0], x[512:] @ weight[1]])
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("bad", [-1, 1.5, "1", None, True])
def test_bad_limits_are_refused(bad):
    with pytest.raises(ValueError, match="limit_bytes"):
        set_cached_buffer_limit(bad)


def test_environment_sets_the_limit():
    code = "import tutel; from tutel.ops.host_buffers import cached_buffer_stats; " \
           "print(cached_buffer_stats()['limit_bytes'])"
    env = dict(os.environ, TUTEL_HOST_CACHE_BYTES="12345")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "12345"


def test_to_dtype_passes_opcheck():
    torch.library.opcheck(torch.ops.tutel.to_dtype.default, (torch.randn(7, 5).bfloat16(), torch.float32),
                          test_utils=("test_schema", "test_faketensor"))


def test_select_rows_passes_opcheck():
    torch.library.opcheck(torch.ops.tutel.select_rows.default, (torch.randn(7, 5), torch.tensor([6, 0, 0, 3])),
                          test_utils=("test_schema", "test_faketensor"))
