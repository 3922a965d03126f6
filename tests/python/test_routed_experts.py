"""tutel.experts.routed_experts against a float64 loop over tokens and choices: values and the
gradients of x, weights, both weight tensors and both biases."""
import pytest
import torch
import torch.nn.functional as F

from tutel.experts import routed_experts
from tutel.ops import direct
from tutel.ops.gated_units import SWIGLU, GatedUnit
from tutel.paths import WeightExperts, experts_pieces, facts

TOLERANCE = {torch.float64: (1e-10, 1e-10), torch.float32: (2e-4, 2e-5),
             torch.bfloat16: (4e-2, 4e-2), torch.float16: (4e-3, 4e-3)}


def linear(v, weight, bias, transposed):
    out = v @ weight if transposed else v @ weight.t()
    return out if bias is None else out + bias


def gated_reference(h, unit):
    """The gated unit on one float64 row [2I] (concatenated or alternating gate and up values)."""
    gate, up = (h[0::2], h[1::2]) if unit.interleaved else h.chunk(2)
    if unit.limit is not None:
        gate, up = gate.clamp(max=unit.limit), up.clamp(-unit.limit, unit.limit)
    return (up + unit.up_offset) * gate * torch.sigmoid(unit.alpha * gate)


def reference(x, ids, weights, up, down, up_bias, down_bias, transposed, gated, post_fn=None, unit=None):
    """Token by token, choice by choice, in float64 (`unit`: a GatedUnit instead of silu(gate) * up)."""
    x, weights, up, down = (t.double() if t is not None else None for t in (x, weights, up, down))
    up_bias, down_bias = (t.double() if t is not None else None for t in (up_bias, down_bias))
    num_experts = up.shape[0]
    rows = []
    for t in range(x.shape[0]):
        total = 0
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if not 0 <= e < num_experts:
                continue
            h = linear(x[t], up[e], None if up_bias is None else up_bias[e], transposed)
            if unit is not None:
                h = gated_reference(h, unit)
            elif gated:
                half = h.shape[0] // 2
                h = h[:half] * torch.sigmoid(h[:half]) * h[half:]
            else:
                h = torch.tanh(h)
            o = linear(h, down[e], None if down_bias is None else down_bias[e], transposed)
            if post_fn is not None:
                o = post_fn(o.unsqueeze(0)).squeeze(0)
            total = total + (1.0 if weights is None else weights[t, j]) * o
        out_dim = down.shape[2] if transposed else down.shape[1]
        rows.append(total if torch.is_tensor(total) else x.new_zeros(out_dim))
    out_dim = down.shape[2] if transposed else down.shape[1]
    return torch.stack(rows) if rows else x.new_zeros((0, out_dim))


def make_case(tokens, hidden, inter, out_dim, experts, k, gated, transposed, bias, sentinels, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    up_out = 2 * inter if gated else inter

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(dtype).requires_grad_()

    x = rand(tokens, hidden)
    scores = torch.rand(tokens, experts, generator=gen)
    ids = scores.topk(min(k, experts), dim=1).indices if k <= experts else \
        torch.randint(0, experts, (tokens, k), generator=gen)
    if sentinels and tokens:
        drop = torch.rand(ids.shape, generator=gen) < 0.3
        ids = torch.where(drop, torch.where(torch.rand(ids.shape, generator=gen) < 0.5, -1, experts), ids)
    weights = rand(tokens, ids.shape[1])
    up = rand(experts, hidden, up_out, scale=hidden ** -0.5) if transposed else \
        rand(experts, up_out, hidden, scale=hidden ** -0.5)
    down = rand(experts, inter, out_dim, scale=inter ** -0.5) if transposed else \
        rand(experts, out_dim, inter, scale=inter ** -0.5)
    up_bias = rand(experts, up_out) if bias else None
    down_bias = rand(experts, out_dim) if bias else None
    return x, ids, weights, up, down, up_bias, down_bias


def run_and_compare(case, transposed, gated, dtype, use_weights=True, post_fn=None, gate_name=True):
    x, ids, weights, up, down, up_bias, down_bias = case
    weights = weights if use_weights else None
    kwargs = dict(up_bias=up_bias, down_bias=down_bias, transposed=transposed, post_fn=post_fn)
    if gated:
        kwargs.update(gate="swiglu") if gate_name else kwargs.update(
            gate_fn=lambda h: F.silu(h.chunk(2, -1)[0]) * h.chunk(2, -1)[1])
    else:
        kwargs.update(activation=torch.tanh)
    y = routed_experts(x, ids, weights, up, down, **kwargs)
    leaves = [t for t in (x, weights, up, down, up_bias, down_bias) if t is not None]
    assert y.dtype == dtype and y.shape[0] == x.shape[0]
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    mapping = dict(zip(map(id, leaves), ref_leaves))
    pick = lambda t: None if t is None else mapping[id(t)]
    ref = reference(pick(x), ids, pick(weights), pick(up), pick(down), pick(up_bias), pick(down_bias),
                    transposed, gated, post_fn)
    rtol, atol = TOLERANCE[dtype]
    torch.testing.assert_close(y.double(), ref, rtol=rtol, atol=atol)
    grad = torch.randn(ref.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    got = torch.autograd.grad(y, leaves, grad.to(dtype), allow_unused=True)
    want = torch.autograd.grad(ref, ref_leaves, grad, allow_unused=True) if ref.requires_grad else [None] * len(leaves)
    for g, w, leaf in zip(got, want, ref_leaves):
        g = torch.zeros_like(leaf) if g is None else g.double()
        w = torch.zeros_like(leaf) if w is None else w
        torch.testing.assert_close(g, w, rtol=rtol * 4, atol=atol * 4 * max(1.0, float(w.abs().max()) if w.numel() else 1))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("bias", [False, True])
def test_layouts_and_dtypes(dtype, transposed, gated, bias):
    case = make_case(13, 16, 8, 16, 5, 2, gated, transposed, bias, False, dtype, seed=1)
    run_and_compare(case, transposed, gated, dtype)


@pytest.mark.parametrize("k", range(1, 9))
def test_every_k(k):
    case = make_case(11, 8, 4, 8, 9, k, True, False, True, False, torch.float32, seed=k)
    run_and_compare(case, False, True, torch.float32)


@pytest.mark.parametrize("experts", [1, 2, 7, 64])
def test_expert_counts_with_idle_experts(experts):
    # 64 experts and 6 tokens at k=2: most experts get no token.
    case = make_case(6, 16, 8, 16, experts, 2, True, True, True, False, torch.float32, seed=experts)
    run_and_compare(case, True, True, torch.float32)


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_odd_sizes_take_the_fallback(dtype, transposed):
    case = make_case(7, 13, 5, 11, 6, 3, True, transposed, True, True, dtype, seed=3)
    run_and_compare(case, transposed, True, dtype)


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_sentinel_ids_contribute_nothing(transposed, dtype):
    case = make_case(17, 16, 8, 16, 6, 4, True, transposed, True, True, dtype, seed=5)
    run_and_compare(case, transposed, True, dtype)


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_device_path_never_reads_the_rows_past_the_groups(device_grouped_mm_path, transposed, bias):
    """Dropped choices leave rows past the last group, which routed_experts asks grouped_rows_mm not
    to zero (zero_tail=False); on the path devices take, where they come back as NaN, values and
    gradients still equal the float64 reference."""
    case = make_case(17, 16, 8, 16, 6, 4, True, transposed, bias, True, torch.float32, seed=11)
    run_and_compare(case, transposed, True, torch.float32)


@pytest.mark.parametrize("tokens", [0, 1])
def test_empty_and_single_token(tokens):
    case = make_case(tokens, 16, 8, 16, 4, 2, True, False, True, False, torch.float32, seed=11)
    run_and_compare(case, False, True, torch.float32)


def test_every_choice_dropped():
    x, ids, weights, up, down, ub, db = make_case(5, 16, 8, 16, 4, 2, True, False, True, False, torch.float32, 2)
    ids = torch.full_like(ids, -1)
    run_and_compare((x, ids, weights, up, down, ub, db), False, True, torch.float32)


def test_no_weights_gate_fn_and_post_fn():
    case = make_case(9, 16, 8, 16, 5, 3, True, False, False, False, torch.float64, seed=4)
    norm = lambda o: o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + 1e-6)
    run_and_compare(case, False, True, torch.float64, use_weights=False, post_fn=norm, gate_name=False)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision(dtype):
    case = make_case(19, 32, 16, 32, 6, 2, True, False, True, False, dtype, seed=6)
    run_and_compare(case, False, True, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("transposed", [False, True])
def test_low_precision_with_many_rows_per_expert(no_native_16bit, dtype, transposed):
    # 70 tokens x 2 choices over 3 experts: enough rows per expert that a CPU without 16-bit dot
    # products runs the GEMMs in float32 (tutel.ops.precision), with autograd (.to) and without
    # (the weights widened into reused buffers).
    case = make_case(70, 32, 16, 32, 3, 2, True, transposed, True, False, dtype, seed=12)
    run_and_compare(case, transposed, True, dtype)
    x, ids, weights, up, down, up_bias, down_bias = case
    with torch.no_grad():
        y = routed_experts(x, ids, weights, up, down, up_bias=up_bias, down_bias=down_bias, transposed=transposed,
                           gate="swiglu")
    leaves = [t.detach().double() for t in (x, weights, up, down, up_bias, down_bias)]
    ref = reference(leaves[0], ids, leaves[1], leaves[2], leaves[3], leaves[4], leaves[5], transposed, True)
    rtol, atol = TOLERANCE[dtype]
    assert y.dtype == dtype
    torch.testing.assert_close(y.double(), ref, rtol=rtol, atol=atol)


def test_gemm_dtype_rule():
    from tutel.ops.precision import UPCAST_MIN_ROWS_PER_EXPERT, cpu_has_native, gemm_dtype
    cpu = torch.device("cpu")
    assert gemm_dtype(torch.float32, cpu, 1e6) == torch.float32
    assert gemm_dtype(torch.float64, cpu, 1e6) == torch.float64
    assert gemm_dtype(torch.bfloat16, cpu, UPCAST_MIN_ROWS_PER_EXPERT - 1) == torch.bfloat16
    many = gemm_dtype(torch.bfloat16, cpu, UPCAST_MIN_ROWS_PER_EXPERT)
    assert many == (torch.bfloat16 if cpu_has_native(torch.bfloat16) else torch.float32)


def test_autocast_bfloat16_matches_bfloat16_operands():
    x, ids, weights, up, down, _, _ = make_case(12, 32, 16, 32, 4, 2, True, False, False, False, torch.float32, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = routed_experts(x, ids, weights, up, down, gate="swiglu")
    assert y.dtype == torch.float32
    ref = reference(x.bfloat16().float(), ids, weights, up.bfloat16().float(), down.bfloat16().float(),
                    None, None, False, True)
    torch.testing.assert_close(y.double(), ref, rtol=4e-2, atol=4e-2)
    y.sum().backward()
    assert up.grad is not None and x.grad is not None and weights.grad is not None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_fullgraph_compile_matches_eager(dtype):
    x, ids, weights, up, down, ub, db = make_case(10, 16, 8, 16, 4, 2, True, False, True, True, dtype, 9)
    leaves = [x, weights, up, down, ub, db]

    def step(x, ids, weights, up, down, ub, db):
        return routed_experts(x, ids, weights, up, down, up_bias=ub, down_bias=db, gate="swiglu")

    eager = step(x, ids, *leaves[1:])
    eager_grads = torch.autograd.grad(eager.float().square().sum(), leaves)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    got = compiled(x, ids, *leaves[1:])
    got_grads = torch.autograd.grad(got.float().square().sum(), leaves)
    torch.testing.assert_close(got, eager)
    for g, w in zip(got_grads, eager_grads):
        torch.testing.assert_close(g, w)


def test_bad_arguments_name_what_is_wrong():
    x, ids, weights, up, down, _, _ = make_case(4, 24, 8, 24, 3, 2, True, False, False, False, torch.float32, 1)
    with pytest.raises(ValueError, match="expert_ids"):
        routed_experts(x, ids[:3], weights, up, down, gate="swiglu")
    with pytest.raises(TypeError, match="expert_ids"):
        routed_experts(x, ids.float(), weights, up, down, gate="swiglu")
    with pytest.raises(ValueError, match="weights"):
        routed_experts(x, ids, weights[:, :1], up, down, gate="swiglu")
    with pytest.raises(ValueError, match="gate"):
        routed_experts(x, ids, weights, up, down, gate="geglu")
    with pytest.raises(ValueError, match="gate"):
        routed_experts(x, ids, weights, up, down)
    with pytest.raises(ValueError, match="up_weight"):
        routed_experts(x, ids, weights, up, down, gate="swiglu", transposed=True)
    with pytest.raises(ValueError, match="up_bias"):
        routed_experts(x, ids, weights, up, down, gate="swiglu", up_bias=torch.zeros(3, 5))


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("gate_kind", ["swiglu", "gate_fn", "activation"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_pieces_without_autograd_match_the_reference(monkeypatch, transposed, gate_kind, dtype):
    """Inference runs the grouped rows in pieces, each gathered from the tokens and added back
    into the result (experts cut across piece ends, dropped choices skipped, biases picked per
    row); forced here to 7 rows per piece."""
    monkeypatch.setattr(experts_pieces, "PIECE_BYTES", 1)
    monkeypatch.setattr(experts_pieces, "MIN_PIECE_ROWS", 7)
    monkeypatch.setattr(facts, "MIN_PIECE_ROWS", 7)
    gated = gate_kind != "activation"
    x, ids, weights, up, down, up_bias, down_bias = make_case(23, 16, 8, 12, 5, 3, gated, transposed, True, True,
                                                              dtype, seed=21)
    norm = lambda o: o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + 1e-6)
    kwargs = dict(up_bias=up_bias, down_bias=down_bias, transposed=transposed, post_fn=norm)
    if gate_kind == "swiglu":
        kwargs.update(gate="swiglu")
    elif gate_kind == "gate_fn":
        kwargs.update(gate_fn=lambda h: F.silu(h.chunk(2, -1)[0]) * h.chunk(2, -1)[1])
    else:
        kwargs.update(activation=torch.tanh)
    assert experts_pieces.piece_rows(WeightExperts(up, down, None, None, transposed, None, None, torch.tanh, None)
                                     .grouped_products(up.dtype)[1]) == 7
    with torch.no_grad():
        y = routed_experts(x, ids, weights, up, down, **kwargs)
    leaves = [t.detach().double() for t in (x, weights, up, down, up_bias, down_bias)]
    ref = reference(leaves[0], ids, leaves[1], leaves[2], leaves[3], leaves[4], leaves[5], transposed, gated, norm)
    rtol, atol = TOLERANCE[dtype]
    torch.testing.assert_close(y.double(), ref, rtol=rtol, atol=atol)


def test_pieces_with_every_choice_dropped(monkeypatch):
    """Pieces forced, but no choice kept (every id outside [0, E)): zeros, no piece runs."""
    monkeypatch.setattr(experts_pieces, "PIECE_BYTES", 1)
    monkeypatch.setattr(experts_pieces, "MIN_PIECE_ROWS", 7)
    monkeypatch.setattr(facts, "MIN_PIECE_ROWS", 7)
    x, ids, weights, up, down, _, _ = make_case(23, 16, 8, 12, 5, 3, True, False, False, False, torch.float32, seed=5)
    with torch.no_grad():
        y = routed_experts(x, torch.full_like(ids, 5), weights, up, down, gate="swiglu")
    assert y.shape == (23, 12) and not y.any()


# ---------------------------------------------------------------- inference in one operator call

def detached(case):
    """make_case's tensors without autograd (the ids as they are)."""
    return tuple(t.detach() if t is not None and t.is_floating_point() else t for t in case)


# gpt-oss' rule (alpha 1.702, up + 1, interleaved) with a limit this test's values cross (gpt-oss: 7)
CLAMPED_UNIT = GatedUnit(1.702, 1.0, 0.5, interleaved=True)


def run_without_grad(case, transposed, dtype, unit=SWIGLU, use_weights=True, ids=None):
    """routed_experts under no_grad (on CPU: one call of tutel's routed_gated_experts operator)
    against the float64 reference."""
    x, case_ids, weights, up, down, up_bias, down_bias = case
    ids = case_ids if ids is None else ids
    weights = weights if use_weights else None
    with torch.no_grad():
        y = routed_experts(x, ids, weights, up, down, up_bias=up_bias, down_bias=down_bias, transposed=transposed,
                           gate=unit)
    assert y.dtype == dtype and y.shape == (x.shape[0], down.shape[2] if transposed else down.shape[1])
    double = lambda t: None if t is None else t.detach().double()
    ref = reference(double(x), ids, double(weights), double(up), double(down), double(up_bias), double(down_bias),
                    transposed, True, unit=unit)
    rtol, atol = TOLERANCE[dtype]
    torch.testing.assert_close(y.double(), ref, rtol=rtol, atol=atol)


@pytest.fixture
def one_call_only(monkeypatch):
    """Fails a test whose no-grad gated call takes the step-by-step path instead of the one-call operator."""

    def refuse(*args, **kwargs):
        raise AssertionError("the step-by-step inference path ran")
    monkeypatch.setattr(experts_pieces, "combine_without_grad", refuse)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("unit", [SWIGLU, CLAMPED_UNIT], ids=["swiglu", "clamped"])
def test_one_call_inference(one_call_only, dtype, transposed, bias, unit):
    # odd sizes, dropped choices (ids -1 and E), an expert count where some get no token
    case = make_case(13, 19, 7, 11, 6, 3, True, transposed, bias, True, dtype, seed=31)
    run_without_grad(case, transposed, dtype, unit)


@pytest.mark.parametrize("k", range(1, 9))
def test_one_call_inference_every_k(one_call_only, k):
    case = make_case(9, 16, 8, 12, 9, k, True, False, True, False, torch.float32, seed=40 + k)
    run_without_grad(case, False, torch.float32)


@pytest.mark.parametrize("experts", [1, 2, 64, 80])
def test_one_call_inference_expert_counts(one_call_only, experts):
    case = make_case(5, 16, 8, 16, experts, 2, True, True, False, False, torch.float32, seed=experts)
    run_without_grad(case, True, torch.float32, use_weights=False)


@pytest.mark.parametrize("tokens", [0, 1])
def test_one_call_inference_empty_and_single_token(one_call_only, tokens):
    case = make_case(tokens, 16, 8, 16, 4, 2, True, False, True, False, torch.float32, seed=tokens)
    run_without_grad(case, False, torch.float32)


def test_one_call_inference_int32_ids_and_every_choice_dropped(one_call_only):
    case = make_case(6, 16, 8, 16, 4, 3, True, False, True, True, torch.float32, seed=3)
    run_without_grad(case, False, torch.float32, ids=case[1].int())
    run_without_grad(case, False, torch.float32, ids=torch.full_like(case[1], 4))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_one_call_inference_widened(no_native_16bit, one_call_only, dtype):
    # enough rows per expert that a CPU without 16-bit dot products widens to float32 first
    case = make_case(70, 32, 16, 32, 3, 2, True, False, True, False, dtype, seed=12)
    run_without_grad(case, False, dtype, CLAMPED_UNIT)


def test_one_call_inference_stays_out_of_other_cases(monkeypatch):
    """Gradients, gate_fn / activation experts, post_fn, a down projection in another dtype than the
    up projection and more rows than a piece keep the step-by-step paths."""

    def refuse(*args, **kwargs):
        raise AssertionError("routed_gated_experts ran")
    monkeypatch.setattr(direct, "routed_gated_experts", refuse)
    monkeypatch.setattr(direct, "routed_gated_experts_cpu", refuse)  # the same, bound directly
    case = make_case(9, 16, 8, 16, 5, 3, True, False, True, False, torch.float32, seed=8)
    run_and_compare(case, False, True, torch.float32)  # autograd
    x, ids, weights, up, down, ub, db = detached(case)
    norm = lambda o: o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + 1e-6)
    for kwargs in (dict(gate_fn=lambda h: F.silu(h.chunk(2, -1)[0]) * h.chunk(2, -1)[1]),
                   dict(gate="swiglu", post_fn=norm), dict(gate="swiglu", up_weight=up.double())):
        y = routed_experts(x, ids, weights, kwargs.pop("up_weight", up), down, up_bias=ub, down_bias=db, **kwargs)
        ref = reference(x.double(), ids, weights.double(), up.double(), down.double(), ub.double(), db.double(),
                        False, True, kwargs.get("post_fn"))
        torch.testing.assert_close(y.double(), ref, rtol=2e-4, atol=2e-5)
    monkeypatch.setattr(experts_pieces, "MIN_PIECE_ROWS", 7)
    monkeypatch.setattr(facts, "MIN_PIECE_ROWS", 7)
    monkeypatch.setattr(experts_pieces, "PIECE_BYTES", 1)
    y = routed_experts(x, ids, weights, up, down, up_bias=ub, down_bias=db, gate="swiglu")
    ref = reference(x.double(), ids, weights.double(), up.double(), down.double(), ub.double(), db.double(), False, True)
    torch.testing.assert_close(y.double(), ref, rtol=2e-4, atol=2e-5)


# The operator through the dispatcher, and its CPU implementation bound directly in tutel._C.
ONE_CALL_ENTRIES = {"registered": lambda: torch.ops.tutel.routed_gated_experts,
                    "direct": lambda: direct.routed_gated_experts_cpu}


@pytest.mark.parametrize("entry", sorted(ONE_CALL_ENTRIES))
def test_one_call_operator_rejects_bad_arguments(entry):
    x, ids, weights, up, down, ub, db = detached(make_case(4, 16, 8, 12, 3, 2, True, False, True, False,
                                                           torch.float32, 1))
    op = ONE_CALL_ENTRIES[entry]()
    call = lambda **change: op(*{**dict(x=x, expert_ids=ids, weights=weights, up_weight=up, down_weight=down,
                                        up_bias=ub, down_bias=db), **change}.values(), False, 1.0, 0.0, None, False)
    torch.testing.assert_close(call().double(), reference(x.double(), ids, weights.double(), up.double(),
                                                          down.double(), ub.double(), db.double(), False, True),
                               rtol=2e-4, atol=2e-5)
    for change, error, match in [
            (dict(x=x[0]), ValueError, "`x` must be 2-D"),
            (dict(expert_ids=ids.float()), TypeError, "`expert_ids` must hold integers"),
            (dict(expert_ids=ids[:3]), ValueError, "`expert_ids` must be \\[T, k\\] with T = 4"),
            (dict(weights=weights[:, :1]), ValueError, "`weights` must have the shape"),
            (dict(up_weight=up.double()), TypeError, "`up_weight` must have dtype Float"),
            (dict(down_weight=down[:2]), ValueError, "`down_weight` 2"),
            (dict(up_weight=up[:, :, :15]), ValueError, "must take the 16 features of `x`"),
            (dict(up_weight=up[:, :15]), ValueError, "twice the down projection's 8 inputs"),
            (dict(down_bias=db[:, :5]), ValueError, "`down_bias` must be \\[3, 12\\]")]:
        with pytest.raises(error, match=match):
            call(**change)
    with pytest.raises(ValueError, match="`limit` must be None or a finite number > 0"):
        op(x, ids, weights, up, down, ub, db, False, 1.0, 0.0, -1.0, False)
    # gates from their own matrices (moe_layer's llama_ffn): up holds the ups only
    gate_w, up_w = up[:, :8], up[:, 8:]
    got = op(x, ids, weights, up_w, down, None, db, False, 1.0, 0.0, None, False, gate_w)
    torch.testing.assert_close(got.double(), reference(x.double(), ids, weights.double(), up.double(), down.double(),
                                                       None, db.double(), False, True), rtol=2e-4, atol=2e-5)
    for args, match in [((up_w, down, None, db, False, 1.0, 0.0, None, False, gate_w[:, :7]), "`gate_weight` must have"),
                        ((up_w, down, ub[:, 8:], db, False, 1.0, 0.0, None, False, gate_w), "no `up_bias`"),
                        ((up_w, down, None, db, False, 1.0, 0.0, None, True, gate_w), "cannot be interleaved"),
                        ((up, down, None, db, False, 1.0, 0.0, None, False, up), "must equal the down projection's 8")]:
        with pytest.raises(ValueError, match=match):
            op(x, ids, weights, *args)


def test_one_call_operator_passes_opcheck():
    x, ids, weights, up, down, ub, db = detached(make_case(5, 16, 8, 12, 4, 2, True, True, True, True,
                                                           torch.float32, 2))
    torch.library.opcheck(torch.ops.tutel.routed_gated_experts.default,
                          (x, ids, weights, up, down, ub, db, True, 1.702, 1.0, 7.0, True),
                          test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("transposed", [False, True])
def test_direct_binding_equals_the_registered_operator(dtype, transposed):
    """One C++ function behind both entries: the same bits, and the float64 reference's values, with
    tokens and routing weights read through strides (the weights [T, k] stored as [k, T])."""
    x, ids, weights, up, down, ub, db = detached(make_case(11, 16, 8, 12, 6, 3, True, transposed, True, True, dtype,
                                                           seed=5))
    strided_x = torch.stack([x, -x], 2)[:, :, 0]
    strided_weights = weights.t().contiguous().t()
    assert not strided_x.is_contiguous() and not strided_weights.is_contiguous()
    args = (strided_x, ids, strided_weights, up, down, ub, db, transposed, 1.702, 1.0, 0.5, True)
    got = {name: entry()(*args) for name, entry in ONE_CALL_ENTRIES.items()}
    assert torch.equal(got["direct"], got["registered"])
    ref = reference(x.double(), ids, weights.double(), up.double(), down.double(), ub.double(), db.double(),
                    transposed, True, unit=CLAMPED_UNIT)
    rtol, atol = TOLERANCE[dtype]
    torch.testing.assert_close(got["direct"].double(), ref, rtol=rtol, atol=atol)


def test_dispatch_modes_and_tensor_subclasses_keep_the_registered_operator():
    """Under a Python dispatch mode the inference call goes through the dispatcher, so the mode sees
    tutel's operator (and nothing of its insides); a tensor subclass is never handed to the binding."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from tutel.ops.tracing import direct_call_allowed
    x, ids, weights, up, down, ub, db = detached(make_case(7, 16, 8, 12, 5, 2, True, False, True, False,
                                                           torch.float32, seed=9))
    seen = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    assert direct_call_allowed(x, None, up)
    with torch.no_grad(), Record():
        assert not direct_call_allowed(x, up)
        y = routed_experts(x, ids, weights, up, down, up_bias=ub, down_bias=db, gate="swiglu")
    assert seen == ["tutel.routed_gated_experts.default"]
    ref = reference(x.double(), ids, weights.double(), up.double(), down.double(), ub.double(), db.double(), False,
                    True)
    torch.testing.assert_close(y.double(), ref, rtol=2e-4, atol=2e-5)

    class Marked(torch.Tensor):
        pass
    assert not direct_call_allowed(x.as_subclass(Marked)) and not direct_call_allowed(x, up.as_subclass(Marked))


def test_profiles_name_the_direct_call():
    x, ids, weights, up, down, ub, db = detached(make_case(3, 16, 8, 12, 4, 2, True, False, True, False,
                                                           torch.float32, seed=4))
    with torch.no_grad(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        routed_experts(x, ids, weights, up, down, up_bias=ub, down_bias=db, gate="swiglu")
    assert "tutel::routed_gated_experts" in {event.key for event in profile.key_averages()}
