"""experts_implementation="tutel" against transformers' own eager experts, family by family:
tiny random models (every parameter randomised), float64 logits and every parameter gradient
to 1e-10, greedy generation token for token, and float32 / bfloat16 within the dtype's
tolerance of the float64 model."""
import pytest
import torch

pytest.importorskip("transformers")
import tutel.integrations.transformers  # noqa: E402,F401  (registers "tutel")

from tiny_transformers_models import FAMILIES, VOCAB, build  # noqa: E402

FAMILY_NAMES = sorted(FAMILIES)


def _batch(seed: int = 1):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (3, 11), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding in one row: padded positions still go through the experts
    return ids, mask


def _loss(model, ids, mask, seed: int = 2):
    """Cross-entropy plus a random projection of the logits, so every logit carries gradient."""
    out = model(input_ids=ids, attention_mask=mask, labels=ids)
    generator = torch.Generator().manual_seed(seed)
    probe = torch.randn(out.logits.shape, generator=generator, dtype=torch.float64).to(out.logits.dtype)
    return out.loss + (out.logits * probe).sum() / out.logits.numel(), out.logits


def _experts_modules(model):
    return [m for m in model.modules() if hasattr(m, "has_gate") and hasattr(m, "down_proj")]


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_float64_logits_and_every_gradient_equal_eager(family):
    eager, ours = build(family), build(family, experts_implementation="tutel")
    assert ours.config._experts_implementation == "tutel" and _experts_modules(ours)
    for (name, a), b in zip(eager.named_parameters(), ours.parameters()):
        assert torch.equal(a, b), name  # the same random model
    ids, mask = _batch()
    eager_loss, eager_logits = _loss(eager, ids, mask)
    our_loss, our_logits = _loss(ours, ids, mask)
    torch.testing.assert_close(our_logits, eager_logits, rtol=1e-10, atol=1e-10)
    eager_loss.backward()
    our_loss.backward()
    for (name, a), b in zip(eager.named_parameters(), ours.parameters()):
        assert a.grad is not None and b.grad is not None, name
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-10, atol=1e-10, msg=lambda m: f"{name}: {m}")
    # The experts really took part: their weights received gradient.
    for module in _experts_modules(ours):
        assert module.down_proj.grad.abs().sum() > 0


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_float64_greedy_generation_is_token_identical(family):
    eager, ours = build(family), build(family, experts_implementation="tutel")
    ids, mask = _batch(seed=3)
    kwargs = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        expected = eager.generate(ids, **kwargs)
        got = ours.generate(ids, **kwargs)
    assert expected.shape[1] > ids.shape[1]
    assert torch.equal(got, expected)


# (rtol, atol relative to the largest reference value) of an experts module run in a low-precision
# dtype against the float64 eager experts on the same (rounded) inputs and parameters.
LOW_PRECISION = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


def _captured_experts_calls(model, ids, mask):
    """{module name: (hidden_states, top_k_index, top_k_weights)} of one forward of `model`."""
    calls, handles = {}, []
    for name, module in model.named_modules():
        if module in _experts_modules(model):
            def hook(_, args, name=name):
                calls[name] = tuple(a.detach() for a in args)
            handles.append(module.register_forward_pre_hook(hook))
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    for handle in handles:
        handle.remove()
    return calls


def _close(got, want, tolerance, what):
    scale = max(float(want.detach().abs().max()), 1e-30)
    torch.testing.assert_close(got.double(), want, rtol=tolerance, atol=tolerance * scale, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("dtype", sorted(LOW_PRECISION, key=str), ids=str)
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_low_precision_experts_within_the_dtypes_tolerance(family, dtype):
    """Each experts module of a float32 / bfloat16 model, on the inputs its router gave it,
    against transformers' eager experts in float64 with the same rounded values: output and the
    gradients of the tokens, the routing weights and every expert parameter."""
    ours = build(family, dtype=dtype, experts_implementation="tutel")
    truth = build(family)
    with torch.no_grad():
        for a, b in zip(truth.parameters(), ours.parameters()):
            a.copy_(b.double())  # exactly the low-precision values
    calls = _captured_experts_calls(ours, *_batch())
    assert calls
    tolerance = LOW_PRECISION[dtype]
    for name, (hidden, index, weights) in calls.items():
        module, reference = ours.get_submodule(name), truth.get_submodule(name)
        hidden, weights = hidden.requires_grad_(), weights.requires_grad_()
        hidden64, weights64 = (t.detach().double().requires_grad_() for t in (hidden, weights))
        got, want = module(hidden, index, weights), reference(hidden64, index, weights64)
        assert got.dtype == dtype
        _close(got, want, tolerance, f"{name} output")
        probe = torch.randn(want.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
        (got.double() * probe).sum().backward()
        (want * probe).sum().backward()
        _close(hidden.grad, hidden64.grad, tolerance, f"{name} d hidden_states")
        _close(weights.grad, weights64.grad, tolerance, f"{name} d top_k_weights")
        for (pname, a), b in zip(reference.named_parameters(), module.parameters()):
            _close(b.grad, a.grad, tolerance, f"{name}.{pname} gradient")
