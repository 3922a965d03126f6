"""Every layout flag of transformers' experts, module by module: the "tutel" implementation
against the class's own eager forward (float64, to 1e-10, values and every gradient), the
expert-parallel sentinels, empty and one-token batches, low precision and autocast."""
import pytest
import torch

from transformers_test_setup import one_intra_op_thread  # noqa: F401  (autouse fixture)

pytest.importorskip("transformers")
import tutel.integrations.transformers  # noqa: E402,F401  (registers "tutel")

from tiny_transformers_experts import CASES, E, make_inputs, make_pair  # noqa: E402

EXACT = dict(rtol=1e-10, atol=1e-10)


def _run(module, hidden, ids, weights):
    """Output and the gradients of the tokens, the routing weights and every parameter."""
    module.zero_grad()
    hidden, weights = hidden.detach().requires_grad_(), weights.detach().requires_grad_()
    out = module(hidden, ids, weights)
    probe = torch.randn(out.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    (out.double() * probe.to(out.device)).sum().backward()
    grads = {"hidden_states": hidden.grad, "top_k_weights": weights.grad}
    grads.update({name: p.grad for name, p in module.named_parameters()})
    return out, grads


# MuseSpark's post-expert norm computes in float32 whatever the model's dtype: the gradient of its
# weight is a float32 sum over the rows, taken per expert by the eager loop and over all rows at
# once here, so the two agree to float32's rounding only.
FLOAT32_INSIDE = {"post_expert_norm.weight": dict(rtol=1e-6, atol=1e-6)}


def _assert_same(got, want, **tolerance):
    out, grads = got
    expected_out, expected_grads = want
    torch.testing.assert_close(out, expected_out, **tolerance)
    assert grads.keys() == expected_grads.keys()
    for name, grad in expected_grads.items():
        assert grad is not None and grads[name] is not None, name
        torch.testing.assert_close(grads[name], grad, **FLOAT32_INSIDE.get(name, tolerance),
                                   msg=lambda m: f"d {name}: {m}")


@pytest.mark.parametrize("tokens,k", [(13, 3), (1, 2), (6, 5)])
@pytest.mark.parametrize("case", sorted(CASES))
def test_layout_equals_the_eager_experts_in_float64(case, tokens, k):
    eager, ours = make_pair(case)
    inputs = make_inputs(tokens, k)
    _assert_same(_run(ours, *inputs), _run(eager, *inputs), **EXACT)


@pytest.mark.parametrize("case", ["mixtral", "gpt_oss", "nemotron_h"])
def test_empty_batch(case):
    eager, ours = make_pair(case)
    hidden, ids, weights = make_inputs(0, 2)
    out = ours(hidden, ids, weights)
    assert out.shape == (0, hidden.shape[1]) and out.dtype == hidden.dtype


def _assert_same_off_the_sentinels(got, want, sentinel):
    """_assert_same (EXACT) except the routing weights' gradient at the `sentinel` choices, which
    must be zero in `got`: ours gives none there, and what transformers gives depends on its release
    (batched_mm masks the sentinels itself only in later 5.x releases; before, it relied on its
    expert-parallel router zeroing their weights, and their gradient flowed)."""
    assert torch.all(got[1]["top_k_weights"][sentinel] == 0)

    def off_the_sentinels(result):
        out, grads = result
        return out, dict(grads, top_k_weights=torch.where(sentinel, 0.0, grads["top_k_weights"]))
    _assert_same(off_the_sentinels(got), off_the_sentinels(want), **EXACT)


@pytest.mark.parametrize("case", ["mixtral", "gpt_oss"])
def test_expert_parallel_sentinels_contribute_nothing(case):
    """With ``_is_expert_parallel`` ids >= num_experts mark choices other processes compute: no
    output and no gradient (routing weights included), even where the weight there is not zero.
    That is the eager experts with those choices dropped (weight 0, any real expert), and
    transformers' batched_mm on the weights its expert-parallel router hands over (zero there)."""
    eager, ours = make_pair(case)
    for module in (eager, ours):
        module._is_expert_parallel = True
    hidden, ids, weights = make_inputs(11, 3)
    sentinel = torch.rand(ids.shape, generator=torch.Generator().manual_seed(3)) < 0.4
    assert sentinel.any() and not sentinel.all()
    ids = torch.where(sentinel, torch.full_like(ids, E), ids)
    got = _run(ours, hidden, ids, weights)
    eager.config._experts_implementation = "eager"
    dropped = _run(eager, hidden, torch.where(sentinel, 0, ids), torch.where(sentinel, 0.0, weights))
    _assert_same_off_the_sentinels(got, dropped, sentinel)
    # transformers' own handling of the sentinels: batched_mm (float64 has no grouped_mm kernel)
    zeroed = torch.where(sentinel, 0.0, weights)
    eager.config._experts_implementation = "batched_mm"
    _assert_same_off_the_sentinels(_run(ours, hidden, ids, zeroed), _run(eager, hidden, ids, zeroed), sentinel)


# (rtol, atol relative to the largest reference value)
LOW_PRECISION = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}


def _close(got, want, tolerance, what):
    scale = max(float(want.detach().abs().max()), 1e-30)
    torch.testing.assert_close(got.double(), want.double(), rtol=tolerance, atol=tolerance * scale,
                               msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("dtype", sorted(LOW_PRECISION, key=str), ids=str)
@pytest.mark.parametrize("case", ["gpt_oss", "mixtral", "muse_spark", "nemotron_h"])
def test_low_precision_against_float64(case, dtype):
    """The module in a low-precision dtype against the eager experts in float64 on the same
    rounded parameters and inputs."""
    eager, ours = make_pair(case, dtype=dtype)
    eager = eager.double()
    inputs = make_inputs(17, 3, dtype=dtype)
    out, grads = _run(ours, *inputs)
    want, want_grads = _run(eager, *(t.double() if t.is_floating_point() else t for t in inputs))
    assert out.dtype == dtype
    _close(out, want, LOW_PRECISION[dtype], "output")
    for name, grad in want_grads.items():
        _close(grads[name], grad, LOW_PRECISION[dtype], f"d {name}")


@pytest.mark.parametrize("case", ["mixtral", "gpt_oss"])
def test_bfloat16_autocast_matches_the_eager_experts_under_autocast(case):
    """float32 parameters and tokens under CPU autocast to bfloat16: the output keeps the tokens'
    dtype like the eager experts' and is as close to the float64 result as theirs."""
    eager, ours = make_pair(case, dtype=torch.float32)
    truth = make_pair(case)[0]
    hidden, ids, weights = make_inputs(17, 3, dtype=torch.float32)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        got = ours(hidden, ids, weights)
        theirs = eager(hidden, ids, weights)
    with torch.no_grad():
        want = truth(hidden.double(), ids, weights.double())
    assert got.dtype == theirs.dtype
    scale = want.detach().abs().max()
    our_error = float((got.double() - want).abs().max() / scale)
    their_error = float((theirs.double() - want).abs().max() / scale)
    assert our_error < max(2 * their_error, 2e-2), (our_error, their_error)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", ["gpt_oss", "mixtral", "nemotron_h"])
def test_on_cuda_against_float64_on_the_cpu(case, dtype):
    """The tutel module on the GPU against the eager experts in float64 on the CPU (same rounded
    parameters and inputs): output and every gradient within the dtype's tolerance."""
    eager, ours = make_pair(case, dtype=dtype)
    eager, ours = eager.double(), ours.cuda()
    inputs = make_inputs(37, 3, dtype=dtype)
    got_out, got_grads = _run(ours, *(t.cuda() for t in inputs))
    want_out, want_grads = _run(eager, *(t.double() if t.is_floating_point() else t for t in inputs))
    tolerance = {torch.float64: 1e-10, torch.float32: 2e-5, torch.bfloat16: 2e-2}[dtype]
    assert got_out.device.type == "cuda" and got_out.dtype == dtype
    _close(got_out.cpu(), want_out, tolerance, "output")
    for name, grad in want_grads.items():
        _close(got_grads[name].cpu(), grad, tolerance, f"d {name}")


def test_gpt_oss_gate_runs_as_the_fused_unit_and_an_override_is_called_as_is():
    """transformers' own GptOssExperts._apply_gate is named as a GatedUnit (the fused kernel, with
    the module's alpha and limit); a subclass that overrides it keeps its own gate function."""
    from tutel.integrations.transformers.layout import read_layout
    from tutel.ops.gated_units import GatedUnit
    _, ours = make_pair("gpt_oss")
    layout = read_layout(ours)
    # the module's own alpha and limit (the config's swiglu_limit 1.5 where the release reads it)
    assert layout.gate == GatedUnit(ours.alpha, 1.0, ours.limit, interleaved=True)

    class Overridden(type(ours)):
        def _apply_gate(self, gate_up):
            return super()._apply_gate(gate_up) * 2

    ours.__class__ = Overridden
    layout = read_layout(ours)
    assert layout.gate is None and layout.gate_fn.__func__ is Overridden._apply_gate
