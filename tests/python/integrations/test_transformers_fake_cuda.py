"""transformers' experts with experts_implementation="tutel" on a CUDA device, traced on fake CUDA
tensors (tests/python/launch_count.py): the model's experts module, through the integration's
forward and tutel's routed experts, never reads a value back to the host, forward and backward,
and launches what the routed experts' budget allows (test_launch_budget.py)."""
import pytest
import torch

from transformers_test_setup import one_intra_op_thread  # noqa: F401  (autouse fixture)

pytest.importorskip("transformers")
import tutel.integrations.transformers  # noqa: E402,F401  (registers "tutel")

from launch_count import OperatorCount, backward_by_hand, fake_cuda, fake_parameters  # noqa: E402
from test_launch_budget import EXPERTS_FORWARD_BUDGET  # noqa: E402
from tiny_transformers_experts import _class  # noqa: E402

# Feature sizes of 16-byte rows in bfloat16, as every published model has (PyTorch's grouped_mm
# needs them; odd sizes take tutel's per-expert products, which read the group sizes back).
HIDDEN, INTERMEDIATE, EXPERTS, K = 64, 40, 8, 2


def _experts_module(kind: str) -> torch.nn.Module:
    """The family's experts class with "tutel" as its implementation, built on the meta device."""
    import transformers
    sizes = dict(hidden_size=HIDDEN, num_attention_heads=2, num_key_value_heads=1, num_local_experts=EXPERTS,
                 intermediate_size=INTERMEDIATE)
    config = transformers.MixtralConfig(**sizes) if kind == "mixtral" else transformers.GptOssConfig(**sizes)
    config._experts_implementation = "tutel"
    with torch.device("meta"):
        return _class(kind)(config)


@pytest.mark.parametrize("kind", ["gpt_oss", "mixtral"])
@pytest.mark.parametrize("tokens", [1, 16, 2048])
def test_tutel_experts_trace_on_fake_cuda(kind, tokens):
    ours = _experts_module(kind)
    with fake_cuda() as mode:
        fake_parameters(ours, mode, dtype=torch.bfloat16)
        hidden = torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        ids = torch.randint(0, EXPERTS, (tokens, K), device="cuda")
        weights = torch.rand(tokens, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        with OperatorCount() as forward:
            y = ours(hidden, ids, weights)
        seed = torch.randn_like(y)
        with OperatorCount() as backward:
            grads = backward_by_hand(y, seed)
    assert y.shape == hidden.shape and y.device.type == "cuda"
    assert forward.kernels <= EXPERTS_FORWARD_BUDGET, forward.operators
    assert backward.kernels <= 2 * forward.kernels, backward.operators
    leaves = [hidden, weights, *ours.parameters()]
    assert {id(t): tuple(t.shape) for t in leaves} == {id(t): tuple(g.shape) for t, g in grads.items()}
