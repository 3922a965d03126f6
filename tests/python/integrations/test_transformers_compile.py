"""torch.compile(fullgraph=True) of a transformers MoE model whose experts run through tutel:
the whole forward is one graph (fullgraph raises at a break), and logits and gradients equal
transformers' own eager experts in eager mode."""
import pytest
import torch

from transformers_test_setup import one_intra_op_thread  # noqa: F401  (autouse fixture)

pytest.importorskip("transformers")
import tutel.integrations.transformers  # noqa: E402,F401  (registers "tutel")

from tiny_transformers_models import VOCAB, build  # noqa: E402


def _logits(model, ids):
    return model(input_ids=ids, use_cache=False).logits


def _skip_unless_transformers_compiles(compiled, reference, ids):
    """Skips the running test where transformers' own model (its eager experts) does not compile with
    fullgraph=True either: a PyTorch whose compiler cannot trace transformers' code tests nothing of
    tutel's.  Returns where it compiles, so the failure with tutel's experts stands."""
    import transformers
    try:
        compiled(reference, ids)
    except torch._dynamo.exc.Unsupported as error:
        pytest.skip(f"transformers {transformers.__version__}'s own model does not compile with fullgraph=True "
                    f"on torch {torch.__version__}: {str(error).strip().splitlines()[0]}")


@pytest.mark.slow
def test_fullgraph_compile_of_a_gpt_oss_model_equals_eager_mode():
    # gpt-oss: transposed weights, biases, interleaved halves and a custom clamped gate.  Sizes
    # whose rows are 16-byte aligned in float32, so the experts take the grouped-GEMM path.
    torch._dynamo.reset()
    sizes = dict(intermediate_size=8, num_hidden_layers=1)  # one layer: the graph is the same per layer
    model = build("gpt_oss", dtype=torch.float32, experts_implementation="tutel", **sizes)
    reference = build("gpt_oss", dtype=torch.float32, experts_implementation="eager", **sizes)
    ids = torch.randint(3, VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))
    # aot_eager: dynamo's capture (fullgraph) and AOT autograd's tracing, without inductor's
    # code generation, which would only add minutes here.
    compiled = torch.compile(_logits, fullgraph=True, backend="aot_eager")
    try:
        got = compiled(model, ids)
    except torch._dynamo.exc.Unsupported:
        _skip_unless_transformers_compiles(compiled, reference, ids)
        raise
    want = _logits(reference, ids)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    probe = torch.randn(want.shape, generator=torch.Generator().manual_seed(1))
    (got * probe).sum().backward()
    (want * probe).sum().backward()
    for (name, a), b in zip(reference.named_parameters(), model.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")
