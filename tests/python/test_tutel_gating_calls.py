"""Tutel 0.4.2's fast gating calls (tutel.ops.qwen3_moe_scaled_topk, deepseek_moe_sigmoid_scaled_topk,
kimi_moe_sigmoid_scaled_topk) against float64 references written token by token from the models'
routers (transformers' Qwen3MoeTopKRouter and DeepseekV3TopkRouter; Kimi-K2 is DeepSeek-V3's router
with one group and a scaling factor of 2.827), against those router modules themselves, on fake CUDA
tensors, and with bad input."""
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers.models.deepseek_v3 import configuration_deepseek_v3, modeling_deepseek_v3
from transformers.models.qwen3_moe import configuration_qwen3_moe, modeling_qwen3_moe

from conftest import tolerance
from tutel import ops

INPUT_DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]


def computed_in(dtype):
    """The dtype the calls compute and return weights in: float64 for float64 input, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# ----- float64 references, one token at a time -----------------------------------------------------

def best_first(values, allowed):
    """The allowed indices of `values` (a list of floats), largest first, equal values by index."""
    return sorted(allowed, key=lambda i: (-values[i], i))


def qwen3_reference(probs, k):
    """Qwen3-MoE: the k largest probabilities, divided by their sum.  probs [T, E] float64."""
    ids, weights = [], []
    for row in probs.tolist():
        chosen = best_first(row, range(len(row)))[:k]
        total = sum(row[e] for e in chosen)
        ids.append(chosen)
        weights.append([row[e] / total for e in chosen])
    return torch.tensor(weights, dtype=torch.float64).view(-1, k), torch.tensor(ids, dtype=torch.int64).view(-1, k)


def sigmoid_choice(z, bias, k, n_group, topk_group):
    """DeepSeek-V3's choice for one token: (ids best first, the biased scores c of all experts)."""
    experts = len(z)
    s = [1.0 / (1.0 + math.exp(-v)) for v in z]
    c = [s[e] + (bias[e] if bias is not None else 0.0) for e in range(experts)]
    allowed = range(experts)
    if n_group is not None:
        size = experts // n_group
        group_score = [sum(sorted(c[g * size:(g + 1) * size], reverse=True)[:2]) for g in range(n_group)]
        kept = best_first(group_score, range(n_group))[:topk_group]
        allowed = [e for e in range(experts) if e // size in kept]
    return best_first(c, allowed)[:k], c


def sigmoid_weights(z, ids, scale):
    """s[ids] / sum(s[ids]) * scale, with s = sigmoid(z)."""
    s = [1.0 / (1.0 + math.exp(-z[e])) for e in ids]
    return [v / sum(s) * scale for v in s]


def check_sigmoid_routing(weights, ids, logits, bias, k, n_group, topk_group, scale, dtype):
    """The call's (weights, ids) against the reference from the same (rounded) inputs in float64.  A
    token may choose otherwise than the reference only between experts whose reference scores c the
    computation's rounding cannot tell apart; its weights are then checked for its own choice."""
    rows = logits.double().reshape(-1, logits.shape[-1]).tolist()
    b = bias.double().tolist() if bias is not None else None
    assert ids.dtype == torch.int32 and tuple(ids.shape) == (len(rows), k)
    assert weights.dtype == computed_in(dtype) and tuple(weights.shape) == (len(rows), k)
    rounding = 8 * torch.finfo(computed_in(dtype)).eps
    expected = []
    for t, z in enumerate(rows):
        ref_ids, c = sigmoid_choice(z, b, k, n_group, topk_group)
        got = ids[t].tolist()
        if got != ref_ids:
            assert len(set(got)) == k
            for mine, theirs in zip(got, ref_ids):
                assert abs(c[mine] - c[theirs]) <= rounding * (1 + abs(c[theirs])), (t, got, ref_ids)
        expected.append(sigmoid_weights(z, got, scale))
    expected = torch.tensor(expected, dtype=torch.float64).view(-1, k)
    torch.testing.assert_close(weights.double(), expected, **tolerance(computed_in(dtype)))


def sigmoid_inputs(shape, dtype, bias_dtype=torch.float32):
    """Logits of the gate's size (|z| up to a few) and a bias of DeepSeek's size, rounded to their dtypes."""
    logits = (torch.randn(shape, dtype=torch.float64) * 2).to(dtype)
    bias = (torch.randn(shape[-1], dtype=torch.float64) * 0.3).to(bias_dtype)
    return logits, bias


# ----- Qwen3-MoE -----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", INPUT_DTYPES)
@pytest.mark.parametrize("experts", [7, 13, 128])
def test_qwen3_matches_reference(dtype, experts):
    for k in range(1, min(8, experts) + 1):
        for shape in [(0, experts), (1, experts), (9, experts), (2, 3, experts)]:
            probs = torch.softmax(torch.randn(shape, dtype=torch.float64) * 2, dim=-1).to(dtype)
            weights, ids = ops.qwen3_moe_scaled_topk(probs, top_k=k)
            expected_weights, expected_ids = qwen3_reference(probs.double().reshape(-1, experts), k)
            assert ids.dtype == torch.int32 and weights.dtype == computed_in(dtype)
            assert torch.equal(ids.long(), expected_ids), (k, shape)  # chosen on the input's own values
            torch.testing.assert_close(weights.double(), expected_weights, **tolerance(computed_in(dtype)))


def test_qwen3_is_tutels_top_8_and_sums_to_one():
    """Tutel's README call: 32 tokens of 128 experts' float32 probabilities, 8 experts each."""
    probs = torch.softmax(torch.randn(32, 128), -1, dtype=torch.float32)
    weights, ids = ops.qwen3_moe_scaled_topk(probs)
    assert weights.shape == (32, 8) and ids.shape == (32, 8) and weights.dtype == torch.float32
    assert weights.is_contiguous() and ids.is_contiguous()
    torch.testing.assert_close(weights.sum(-1), torch.ones(32), rtol=0, atol=4 * torch.finfo(torch.float32).eps)
    assert torch.equal(ids.long(), qwen3_reference(probs.double(), 8)[1])


@pytest.mark.parametrize("dtype", INPUT_DTYPES)
def test_qwen3_ties_go_to_the_lower_expert(dtype):
    probs = torch.tensor([[0.1, 0.2, 0.05, 0.2, 0.2, 0.05, 0.2],
                          [0.25, 0.25, 0.25, 0.25, 0.0, 0.0, 0.0]], dtype=dtype)
    weights, ids = ops.qwen3_moe_scaled_topk(probs, top_k=5)
    assert ids.tolist() == [[1, 3, 4, 6, 0], [0, 1, 2, 3, 4]]
    expected = torch.tensor([[2 / 9, 2 / 9, 2 / 9, 2 / 9, 1 / 9], [0.25, 0.25, 0.25, 0.25, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(weights.double(), expected, **tolerance(computed_in(dtype)))


# ----- DeepSeek-V3 / R1 and Kimi-K2 ------------------------------------------------------------------

# (experts, n_group, topk_group): DeepSeek-V3's own, odd expert counts, one expert per group, no limit.
GROUPINGS = [(256, 8, 4), (12, 4, 2), (15, 5, 3), (9, 3, 1), (7, 7, 3), (13, None, None), (11, 1, 1)]


@pytest.mark.parametrize("dtype", INPUT_DTYPES)
@pytest.mark.parametrize("experts, n_group, topk_group", GROUPINGS)
def test_deepseek_matches_reference(dtype, experts, n_group, topk_group):
    allowed = experts if n_group is None else topk_group * (experts // n_group)
    for k in range(1, min(8, allowed) + 1):
        for shape, scale in [((0, experts), 2.5), ((1, experts), 1.0), ((7, experts), 2.5), ((2, 3, experts), 0.7)]:
            logits, bias = sigmoid_inputs(shape, dtype, bias_dtype=dtype)
            weights, ids = ops.deepseek_moe_sigmoid_scaled_topk(logits, bias, top_k=k, n_group=n_group,
                                                                topk_group=topk_group, routed_scaling_factor=scale)
            check_sigmoid_routing(weights, ids, logits, bias, k, n_group, topk_group, scale, dtype)


@pytest.mark.parametrize("dtype", INPUT_DTYPES)
def test_deepseek_defaults_are_deepseek_v3s_router(dtype):
    """No keywords: 8 of 256 experts in 8 groups of which 4 stay, weights summing to 2.5 (Tutel's README
    call, with a bfloat16 bias and a float32 one)."""
    for bias_dtype in (torch.bfloat16, torch.float32):
        logits, bias = sigmoid_inputs((32, 256), dtype, bias_dtype)
        weights, ids = ops.deepseek_moe_sigmoid_scaled_topk(logits, bias, None, None)
        check_sigmoid_routing(weights, ids, logits, bias, 8, 8, 4, 2.5, dtype)
        torch.testing.assert_close(weights.double().sum(-1), torch.full((32,), 2.5, dtype=torch.float64),
                                   **tolerance(computed_in(dtype)))


@pytest.mark.parametrize("dtype", INPUT_DTYPES)
@pytest.mark.parametrize("experts", [384, 11, 8])
def test_kimi_matches_reference(dtype, experts):
    """Kimi-K2: DeepSeek-V3's router with one group; 2.827 by default, any k and scale by keyword."""
    for k in range(1, 9):
        for shape in [(0, experts), (1, experts), (6, experts), (2, 2, experts)]:
            logits, bias = sigmoid_inputs(shape, dtype)
            weights, ids = ops.kimi_moe_sigmoid_scaled_topk(logits, bias, top_k=k)
            check_sigmoid_routing(weights, ids, logits, bias, k, None, None, 2.827, dtype)
    logits, bias = sigmoid_inputs((5, experts), dtype)
    weights, ids = ops.kimi_moe_sigmoid_scaled_topk(logits, bias, routed_scaling_factor=1.5)
    check_sigmoid_routing(weights, ids, logits, bias, 8, None, None, 1.5, dtype)


def test_without_a_correction_bias():
    logits = torch.randn(6, 12, dtype=torch.float64)
    weights, ids = ops.deepseek_moe_sigmoid_scaled_topk(logits, None, top_k=3, n_group=4, topk_group=2)
    check_sigmoid_routing(weights, ids, logits, None, 3, 4, 2, 2.5, torch.float64)


@pytest.mark.parametrize("dtype", INPUT_DTYPES)
def test_sigmoid_ties_go_to_the_lower_expert_and_group(dtype):
    """Experts with equal logits and biases tie exactly in any precision: the lower expert wins; groups
    with equal contents tie too: the lower group stays."""
    logits = torch.tensor([[0.5, -1.0, 0.5, 2.0] * 4, [1.0] * 8 + [3.0] * 8], dtype=dtype)
    bias = torch.tensor([0.25, 0.0, 0.25, -0.5] * 4, dtype=dtype)
    weights, ids = ops.deepseek_moe_sigmoid_scaled_topk(logits, bias, top_k=4, n_group=4, topk_group=2)
    # Token 0: c = s + b is largest (and equal) at experts 0 and 2 of every group, so the four groups
    # tie and groups 0 and 1 stay.  Token 1: groups 2 and 3 lead; experts 8, 10, 12, 14 tie first.
    assert ids.tolist() == [[0, 2, 4, 6], [8, 10, 12, 14]]
    check_sigmoid_routing(weights, ids, logits, bias, 4, 4, 2, 2.5, dtype)


def test_output_buffers_receive_the_first_k_columns():
    """Tutel's buffers: a [T, 9] pair whose last column holds the shared expert (id E, weight 1)."""
    tokens, experts = 5, 256
    logits, bias = sigmoid_inputs((1, tokens, experts), torch.bfloat16, torch.bfloat16)
    top_v_out = torch.full((tokens, 9), 1.0)
    top_k_out = torch.full((tokens, 9), experts, dtype=torch.int32)
    weights, ids = ops.deepseek_moe_sigmoid_scaled_topk(logits, bias, top_v_out, top_k_out)
    assert weights.data_ptr() == top_v_out.data_ptr() and ids.data_ptr() == top_k_out.data_ptr()
    assert weights.shape == (tokens, 9) and ids.shape == (tokens, 9)
    assert torch.equal(top_v_out[:, 8], torch.ones(tokens)) and torch.equal(top_k_out[:, 8], torch.full(
        (tokens,), experts, dtype=torch.int32))
    fresh_weights, fresh_ids = ops.deepseek_moe_sigmoid_scaled_topk(logits, bias)
    assert torch.equal(top_v_out[:, :8], fresh_weights) and torch.equal(top_k_out[:, :8], fresh_ids)
    # A flat buffer of T * 8 entries, one buffer only, and T = 0 with empty buffers.
    flat = torch.zeros(tokens * 8)
    weights, ids = ops.kimi_moe_sigmoid_scaled_topk(logits[..., :16], bias[:16], flat)
    assert weights.data_ptr() == flat.data_ptr() and torch.equal(flat.view(tokens, 8), weights)
    assert ids.shape == (tokens, 8)
    weights, ids = ops.deepseek_moe_sigmoid_scaled_topk(torch.empty(0, experts), bias, torch.empty(0),
                                                        torch.empty(0, 8, dtype=torch.int32))
    assert weights.shape == (0, 8) and ids.shape == (0, 8)
    # A bad second buffer raises before the first one is written.
    untouched = torch.full((tokens, 8), -1.0)
    with pytest.raises(TypeError, match="top_k_out"):
        ops.deepseek_moe_sigmoid_scaled_topk(logits, bias, untouched, torch.zeros(tokens, 8))
    assert torch.equal(untouched, torch.full((tokens, 8), -1.0))


def test_weights_carry_gradients_to_the_inputs():
    """The weights are differentiable in the logits (probabilities) where the choice does not change."""
    logits = torch.randn(4, 12, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(12, dtype=torch.float64)
    torch.autograd.gradcheck(lambda z: ops.deepseek_moe_sigmoid_scaled_topk(z, bias, top_k=3, n_group=4,
                                                                            topk_group=2)[0], (logits,))
    torch.autograd.gradcheck(lambda z: ops.kimi_moe_sigmoid_scaled_topk(z, bias, top_k=5)[0], (logits,))
    probs = torch.softmax(torch.randn(4, 9, dtype=torch.float64), -1).requires_grad_()
    torch.autograd.gradcheck(lambda p: ops.qwen3_moe_scaled_topk(p, top_k=4)[0], (probs,))


# ----- against transformers' routers -----------------------------------------------------------------

def randomized(router):
    with torch.no_grad():
        for tensor in list(router.parameters()) + list(router.buffers()):
            tensor.copy_(torch.randn_like(tensor) * 0.5)
    return router


def same_choices(weights, ids, expected_weights, expected_ids):
    """transformers' DeepSeek router lists a token's choices in no particular order: compare sorted."""
    order, expected_order = ids.long().sort(dim=1), expected_ids.long().sort(dim=1)
    assert torch.equal(order.values, expected_order.values)
    torch.testing.assert_close(weights.gather(1, order.indices), expected_weights.gather(1, expected_order.indices),
                               **tolerance(torch.float32))


@pytest.mark.parametrize("experts, k, n_group, topk_group, scale", [
    (12, 3, 4, 2, 2.5),      # DeepSeek-V3's router, small
    (15, 8, 5, 3, 2.5),
    (11, 8, 1, 1, 2.827),    # Kimi-K2's: one group
])
def test_deepseek_and_kimi_equal_transformers_router(experts, k, n_group, topk_group, scale):
    config = configuration_deepseek_v3.DeepseekV3Config(
        hidden_size=6, n_routed_experts=experts, num_experts_per_tok=k, n_group=n_group, topk_group=topk_group,
        routed_scaling_factor=scale, norm_topk_prob=True)
    router = randomized(modeling_deepseek_v3.DeepseekV3TopkRouter(config))
    logits, expected_weights, expected_ids = router(torch.randn(3, 7, 6))
    bias = router.e_score_correction_bias
    if n_group == 1:
        weights, ids = ops.kimi_moe_sigmoid_scaled_topk(logits, bias, top_k=k, routed_scaling_factor=scale)
    else:
        weights, ids = ops.deepseek_moe_sigmoid_scaled_topk(logits, bias, top_k=k, n_group=n_group,
                                                            topk_group=topk_group, routed_scaling_factor=scale)
    same_choices(weights, ids, expected_weights, expected_ids)


@pytest.mark.parametrize("experts, k", [(9, 4), (128, 8), (7, 1)])
def test_qwen3_equals_transformers_router(experts, k):
    config = configuration_qwen3_moe.Qwen3MoeConfig(hidden_size=6, num_experts=experts, num_experts_per_tok=k,
                                                    norm_topk_prob=True)
    router = randomized(modeling_qwen3_moe.Qwen3MoeTopKRouter(config))
    logits, expected_weights, expected_ids = router(torch.randn(3, 7, 6))
    weights, ids = ops.qwen3_moe_scaled_topk(torch.softmax(logits, -1, dtype=torch.float32), top_k=k)
    assert torch.equal(ids.long(), expected_ids)
    torch.testing.assert_close(weights, expected_weights, **tolerance(torch.float32))


# ----- devices: fake CUDA tensors, no host synchronisation ------------------------------------------

def test_fake_cuda_tensors_trace_without_host_synchronisation():
    """On fake CUDA tensors every call runs: a host synchronisation (reading a value) or a size that
    depends on the data would raise there, so the CUDA path has neither."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        logits = torch.empty(2, 3, 256, device="cuda", dtype=torch.bfloat16)
        bias = torch.empty(256, device="cuda", dtype=torch.bfloat16)
        top_v_out = torch.empty(6, 9, device="cuda")
        top_k_out = torch.empty(6, 9, device="cuda", dtype=torch.int32)
        for call in (ops.deepseek_moe_sigmoid_scaled_topk, ops.kimi_moe_sigmoid_scaled_topk):
            weights, ids = call(logits, bias)
            assert weights.device.type == "cuda" and weights.shape == (6, 8) and weights.dtype == torch.float32
            assert ids.device.type == "cuda" and ids.shape == (6, 8) and ids.dtype == torch.int32
            weights, ids = call(logits, bias, top_v_out, top_k_out)
            assert weights.shape == (6, 9) and ids.shape == (6, 9) and ids.device.type == "cuda"
        probs = torch.empty(4, 128, device="cuda")
        weights, ids = ops.qwen3_moe_scaled_topk(probs)
        assert weights.device.type == "cuda" and weights.shape == (4, 8) and ids.dtype == torch.int32
        weights, ids = ops.qwen3_moe_scaled_topk(torch.empty(0, 128, device="cuda", dtype=torch.float16), top_k=3)
        assert weights.shape == (0, 3) and weights.dtype == torch.float32


class _Operators(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def test_the_calls_run_tutels_routing_operators_and_read_no_value():
    """The same tensor code on real tensors: tutel's routing operator, and no operator that reads a
    value back to the host (.item(), nonzero) on the way."""
    logits, bias = sigmoid_inputs((5, 256), torch.bfloat16, torch.bfloat16)
    with _Operators() as sigmoid_calls:
        ops.deepseek_moe_sigmoid_scaled_topk(logits, bias, torch.zeros(5, 9), torch.zeros(5, 9, dtype=torch.int32))
    with _Operators() as softmax_calls:
        ops.qwen3_moe_scaled_topk(torch.softmax(torch.randn(5, 128), -1))
    assert "tutel.route_experts" in sigmoid_calls.names and "tutel.route_topk" in softmax_calls.names
    for names in (sigmoid_calls.names, softmax_calls.names):
        assert not names & {"aten._local_scalar_dense", "aten.nonzero", "aten.item", "aten.masked_select"}, names


# ----- bad input ---------------------------------------------------------------------------------------

E = 16
Z = torch.randn(3, E)
B = torch.randn(E)


@pytest.mark.parametrize("call, error, match", [
    (lambda: ops.qwen3_moe_scaled_topk(Z.softmax(-1), top_k=0), ValueError, "top_k"),
    (lambda: ops.qwen3_moe_scaled_topk(Z.softmax(-1), top_k=E + 1), ValueError, "top_k=17 exceeds .*16"),
    (lambda: ops.qwen3_moe_scaled_topk(torch.rand(3, 5)), ValueError, "top_k=8 exceeds num_global_experts=5"),
    (lambda: ops.qwen3_moe_scaled_topk(torch.tensor(0.5)), ValueError, "`router_probs` must have at least 1 dim"),
    (lambda: ops.qwen3_moe_scaled_topk(torch.rand(3, 0)), ValueError, "`router_probs`.*E >= 1"),
    (lambda: ops.qwen3_moe_scaled_topk(torch.ones(3, E, dtype=torch.int64)), TypeError, "`router_probs` must be"),
    (lambda: ops.qwen3_moe_scaled_topk([0.5, 0.5], top_k=1), TypeError, "`router_probs` must be a torch.Tensor"),
    (lambda: ops.qwen3_moe_scaled_topk(Z.softmax(-1), top_k=2.0), TypeError, "`top_k` must be an integer"),
    (lambda: ops.deepseek_moe_sigmoid_scaled_topk(Z, B, top_k=9, n_group=4, topk_group=2), ValueError,
     "k=9 exceeds the 8 experts"),
    (lambda: ops.deepseek_moe_sigmoid_scaled_topk(Z, B, top_k=0, n_group=None, topk_group=None), ValueError, "top_k"),
    (lambda: ops.deepseek_moe_sigmoid_scaled_topk(torch.randn(3, 12), torch.randn(12)), ValueError,
     "n_group=8 is not allowed.*12 experts"),
    (lambda: ops.deepseek_moe_sigmoid_scaled_topk(Z, B, top_k=2, n_group=4, topk_group=5), ValueError,
     "topk_group=5 is not allowed"),
    (lambda: ops.deepseek_moe_sigmoid_scaled_topk(Z, B, top_k=2, n_group=4, topk_group=None), ValueError,
     "n_group and topk_group"),
    (lambda: ops.deepseek_moe_sigmoid_scaled_topk(Z, torch.randn(E + 1)), ValueError,
     r"`correction_bias` must have shape \[num_experts\] = \[16\], got \(17,\)"),
    (lambda: ops.deepseek_moe_sigmoid_scaled_topk(Z, torch.randn(1, E)), ValueError, "`correction_bias` must have"),
    (lambda: ops.kimi_moe_sigmoid_scaled_topk(Z, torch.ones(E, dtype=torch.int32)), TypeError, "`correction_bias`"),
    (lambda: ops.kimi_moe_sigmoid_scaled_topk(Z.to(torch.int32), B), TypeError, "`logits` must be float32"),
    (lambda: ops.kimi_moe_sigmoid_scaled_topk(torch.tensor(1.0), B), ValueError, "`logits` must have at least"),
    (lambda: ops.kimi_moe_sigmoid_scaled_topk(Z, B, routed_scaling_factor=math.nan), ValueError,
     "routed_scaling_factor"),
    (lambda: ops.kimi_moe_sigmoid_scaled_topk(Z, B, routed_scaling_factor="2.5"), TypeError, "routed_scaling_factor"),
    (lambda: ops.kimi_moe_sigmoid_scaled_topk(Z, B, torch.zeros(3, 8, dtype=torch.bfloat16)), TypeError,
     "`top_v_out` must be torch.float32"),
    (lambda: ops.kimi_moe_sigmoid_scaled_topk(Z, B, None, torch.zeros(3, 8)), TypeError,
     "`top_k_out` must be torch.int32"),
    (lambda: ops.kimi_moe_sigmoid_scaled_topk(Z, B, torch.zeros(3, 7)), ValueError,
     "`top_v_out` of shape \\(3, 7\\) does not hold 3 rows of at least k=8"),
    (lambda: ops.kimi_moe_sigmoid_scaled_topk(Z, B, torch.zeros(25)), ValueError, "`top_v_out`"),
    (lambda: ops.kimi_moe_sigmoid_scaled_topk(Z, B, torch.zeros(9, 3).t()), ValueError,
     "`top_v_out` must be contiguous"),
    (lambda: ops.kimi_moe_sigmoid_scaled_topk(Z, B, torch.zeros(3, 8, device="meta")), ValueError,
     "`top_v_out` is on meta"),
    (lambda: ops.kimi_moe_sigmoid_scaled_topk(Z, B.to("meta")), ValueError, "`correction_bias` is on meta"),
])
def test_bad_input_names_the_argument(call, error, match):
    with pytest.raises(error, match=match):
        call()
