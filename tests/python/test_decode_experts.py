"""tutel.ops.decode_experts (the operator tutel::decode_experts) on CPU: against a float64 plain
PyTorch reference (T = 0 to 32, k 1 to 8, E 1 to 256, odd sizes, experts without tokens, repeated
experts, ids outside [0, E), every dtype, both weight layouts, SwiGLU, gpt-oss' clamped
interleaved unit with biases and separate gate matrices) and against
tutel.experts.routed.routed_experts; on fake CUDA tensors one operator of the right shape and
dtype; decode_experts_supported; bad input named.  (The CUDA kernels themselves run on the CPU
in tests/cpp/kernels_on_cpu/decode_experts_cu_test.cpp; on a CUDA device the reference tests run
them too, and a test checks that they repeat bit for bit, in a CUDA graph as well.)"""
import pytest
import torch

from conftest import ALL_DTYPES, tolerance
from launch_count import OperatorCount, fake_cuda
from tutel.experts.routed import routed_experts
from tutel.ops.decode_experts import DECODE_MAX_CHOICES, DECODE_MAX_TOKENS, decode_experts, decode_experts_supported
from tutel.ops.gated_units import SWIGLU, GatedUnit

GPT_OSS = GatedUnit(alpha=1.702, up_offset=1.0, limit=1.25, interleaved=True)  # a limit the values cross
FORMS = ["swiglu", "gpt_oss", "separate"]
# Relative to the largest output: each output sums k choices of values rounded to the dtype on
# the way (the up products, the unit, the down products), so its error scales with the largest
# terms, not with its own size.
SCALED_TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 8e-3}


class Problem:
    """Random decode_experts arguments (matrices in the layout asked for) and the unit."""

    def __init__(self, dtype, tokens, k, experts, hidden, inter, outputs, transposed, form, seed):
        gen = torch.Generator().manual_seed(seed)

        def randn(*shape, scale=1.0):
            return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(dtype)

        def layout(shape):  # an [E, out, in] matrix shape, transposed to [E, in, out] if asked
            return (shape[0], shape[2], shape[1]) if transposed else shape

        self.transposed, self.unit = transposed, GPT_OSS if form == "gpt_oss" else SWIGLU
        up_rows = inter if form == "separate" else 2 * inter
        self.x = randn(tokens, hidden)
        self.up_weight = randn(*layout((experts, up_rows, hidden)), scale=2 / max(hidden, 1) ** 0.5)
        self.gate_weight = randn(*layout((experts, up_rows, hidden)), scale=2 / max(hidden, 1) ** 0.5) \
            if form == "separate" else None
        self.down_weight = randn(*layout((experts, outputs, inter)), scale=max(inter, 1) ** -0.5)
        self.up_bias = randn(experts, up_rows, scale=0.5) if form == "gpt_oss" else None
        self.down_bias = randn(experts, outputs, scale=0.5) if form == "gpt_oss" else None
        ids = torch.randint(0, experts, (tokens, k), generator=gen)
        if tokens > 0 and k > 1:
            ids[0, -1] = experts + 2  # out of range: contributes nothing
            ids[-1, 1] = ids[-1, 0]  # a token choosing one expert twice
        if tokens > 2:
            ids[1] = -1  # a token keeping no choice
        self.expert_ids = ids
        self.weights = torch.rand(tokens, k, generator=gen)

    def kwargs(self):
        return dict(up_bias=self.up_bias, down_bias=self.down_bias, transposed=self.transposed, unit=self.unit,
                    gate_weight=self.gate_weight)

    def args(self):
        return self.x, self.expert_ids, self.weights, self.up_weight, self.down_weight


def unit_value(gate, up, unit):
    if unit.limit is not None:
        gate, up = gate.clamp(max=unit.limit), up.clamp(-unit.limit, unit.limit)
    return (up + unit.up_offset) * gate * torch.sigmoid(unit.alpha * gate)


def reference(x, expert_ids, weights, up_weight, down_weight, *, up_bias=None, down_bias=None, transposed=False,
              unit=SWIGLU, gate_weight=None):
    """decode_experts' definition in float64, every (token, choice) at once."""
    experts = up_weight.shape[0]
    kept = (expert_ids >= 0) & (expert_ids < experts)
    e = expert_ids.long().clamp(0, experts - 1)

    def linear(matrix, v):  # v [T, k, in] through each choice's expert matrix
        m = matrix.double()[e]
        return torch.einsum("tki,tkio->tko" if transposed else "tki,tkoi->tko", v, m)

    xs = x.double()[:, None, :].expand(-1, expert_ids.shape[1], -1)
    up = linear(up_weight, xs)
    if up_bias is not None:
        up = up + up_bias.double()[e]
    if gate_weight is not None:
        gate = linear(gate_weight, xs)
    elif unit.interleaved:
        gate, up = up[..., 0::2], up[..., 1::2]
    else:
        gate, up = up.chunk(2, dim=-1)
    y = linear(down_weight, unit_value(gate, up, unit))
    if down_bias is not None:
        y = y + down_bias.double()[e]
    w = torch.ones(expert_ids.shape, dtype=torch.float64) if weights is None else weights.double()
    return (y * torch.where(kept, w, torch.zeros_like(w))[..., None]).sum(1)


def assert_close_scaled(got, want, dtype):
    scale = SCALED_TOLERANCE[dtype] * max(1.0, float(want.abs().max()) if want.numel() else 1.0)
    assert got.dtype == dtype and got.shape == want.shape
    torch.testing.assert_close(got.double(), want, rtol=SCALED_TOLERANCE[dtype], atol=scale)


# (tokens, k, experts, hidden, inter, outputs): odd sizes, 16-byte sizes, experts without tokens
# (E > T k) and experts with many tokens (E < T k), T = 0 and T = 32.
SIZES = [
    (0, 2, 4, 13, 7, 13),
    (1, 1, 1, 13, 7, 13),
    (1, 8, 256, 17, 9, 11),
    (2, 3, 5, 24, 16, 24),
    (5, 4, 8, 33, 19, 33),
    (8, 2, 2, 9, 5, 9),
    (13, 6, 64, 15, 11, 7),
    (32, 8, 256, 16, 8, 16),
    (32, 2, 3, 21, 13, 21),
]


# The operator on the CPU and, where there is one, on a CUDA device (the kernels of
# kernels/decode_experts.cu), against the same float64 reference computed on the CPU.
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DEVICES = ["cpu", pytest.param("cuda", marks=needs_cuda)]


def on(device, *tensors):
    """`tensors` on `device` (None stays None); views keep their strides."""
    return [t.to(device) if isinstance(t, torch.Tensor) else t for t in tensors]


def decode_on(device, p):
    """decode_experts of Problem `p` on `device`, without autograd; the result on the CPU."""
    kwargs = dict(zip(p.kwargs(), on(device, *p.kwargs().values())))
    with torch.no_grad():
        out = decode_experts(*on(device, *p.args()), **kwargs)
    assert out.device.type == device
    return out.cpu()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("transposed", [False, True], ids=["linear", "transposed"])
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("sizes", SIZES, ids=lambda s: "T{}_k{}_E{}_H{}_I{}_O{}".format(*s))
def test_matches_float64_reference(device, dtype, transposed, form, sizes):
    p = Problem(dtype, *sizes, transposed, form, seed=sum(sizes))
    assert_close_scaled(decode_on(device, p), reference(*p.args(), **p.kwargs()), dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tokens", range(0, DECODE_MAX_TOKENS + 1))
def test_every_decode_token_count(device, tokens):
    """T = 0 to 32 with k = 1 + T % 8, bfloat16 with gpt-oss' unit (the common decoding case)."""
    p = Problem(torch.bfloat16, tokens, 1 + tokens % 8, 16, 19, 11, 19, tokens % 2 == 1, "gpt_oss", seed=tokens)
    assert_close_scaled(decode_on(device, p), reference(*p.args(), **p.kwargs()), torch.bfloat16)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("weights_dtype", [None, torch.float64, torch.bfloat16, torch.float16])
def test_int32_ids_strided_routing_and_weight_dtypes(device, weights_dtype):
    """int32 ids, weights of another dtype than the data (or none), [k, T] tensors seen as [T, k]."""
    p = Problem(torch.float32, 6, 3, 5, 11, 7, 11, False, "swiglu", seed=3)
    ids = p.expert_ids.int().t().contiguous().t()
    weights = None if weights_dtype is None else p.weights.to(weights_dtype).t().contiguous().t()
    on_device = on(device, p.x, ids, weights, p.up_weight, p.down_weight)
    assert not on_device[1].is_contiguous()
    with torch.no_grad():
        out = decode_experts(*on_device).cpu()
    assert_close_scaled(out, reference(p.x, ids, weights, p.up_weight, p.down_weight), torch.float32)


def test_no_choices_give_zeros():
    x, up_w, down_w = torch.randn(3, 8), torch.randn(4, 10, 8), torch.randn(4, 6, 5)
    assert torch.equal(decode_experts(x, torch.empty(3, 0, dtype=torch.int64), None, up_w, down_w),
                       torch.zeros(3, 6))
    dropped = torch.tensor([[-1, 4], [7, -3], [4, 4]])
    assert torch.equal(decode_experts(x, dropped, torch.rand(3, 2), up_w, down_w), torch.zeros(3, 6))


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("transposed", [False, True], ids=["linear", "transposed"])
@pytest.mark.parametrize("form", ["swiglu", "gpt_oss"])
@pytest.mark.parametrize("with_grad", [False, True], ids=["no_grad", "grouped_autograd_path"])
def test_matches_routed_experts(dtype, transposed, form, with_grad):
    """The grouped path's result to the dtype's rounding: its no-grad operator, and its autograd
    path (grouped products and the unit as separate steps)."""
    p = Problem(dtype, 7, 4, 12, 17, 9, 13, transposed, form, seed=11)
    with torch.no_grad():
        out = decode_experts(*p.args(), **p.kwargs())
    x = p.x.clone().requires_grad_(with_grad)
    with torch.set_grad_enabled(with_grad):
        want = routed_experts(x, p.expert_ids, p.weights, p.up_weight, p.down_weight, up_bias=p.up_bias,
                              down_bias=p.down_bias, transposed=transposed, gate=p.unit)
    tol = tolerance(dtype)
    torch.testing.assert_close(out, want.detach(), rtol=tol["rtol"],
                               atol=tol["atol"] * max(1.0, float(want.detach().abs().max())))


# ----------------------------------------------------- the CUDA kernels (needs a CUDA device) --
@needs_cuda
@pytest.mark.parametrize("form", ["swiglu", "gpt_oss"])
def test_cuda_results_repeat_bit_for_bit_and_a_cuda_graph_replays_them(form):
    """No float atomics: the same inputs give the same bits, eager or replayed from a CUDA graph
    (whose capture fails if the call synchronises with the host)."""
    p = Problem(torch.bfloat16, 24, 8, 64, 40, 24, 40, True, form, seed=7)
    args = on("cuda", *p.args())
    kwargs = dict(zip(p.kwargs(), on("cuda", *p.kwargs().values())))
    with torch.no_grad():
        first = decode_experts(*args, **kwargs)
        second = decode_experts(*args, **kwargs)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            decode_experts(*args, **kwargs)  # warm-up outside the capture
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = decode_experts(*args, **kwargs)
        graph.replay()
        torch.cuda.synchronize()
    assert torch.equal(first, second) and torch.equal(first, captured)


# -------------------------------------------------------------------- the CUDA path, faked --
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("transposed", [False, True], ids=["linear", "transposed"])
@pytest.mark.parametrize("form", FORMS)
def test_fake_cuda_is_one_operator_of_the_right_shape(dtype, transposed, form):
    """On fake CUDA tensors: [T, O] in x's dtype from one tutel operator, nothing read back."""
    real = Problem(dtype, 3, 4, 8, 16, 10, 12, transposed, form, seed=1)
    with fake_cuda() as mode:
        def fake(t):
            return None if t is None else mode.from_tensor(t).to("cuda")
        args = [fake(t) for t in real.args()]
        kwargs = {name: fake(v) if isinstance(v, torch.Tensor) else v for name, v in real.kwargs().items()}
        with torch.no_grad(), OperatorCount() as count:
            out = decode_experts(*args, **kwargs)
        assert out.shape == (3, 12) and out.dtype == dtype and out.device.type == "cuda"
        assert count.operators == ["tutel.decode_experts.default"]


def test_supported_sizes_dtypes_and_devices():
    assert decode_experts_supported(1, 8, torch.bfloat16, "cpu") is False  # CPU: the grouped path itself
    with fake_cuda():  # a fake CUDA device stands for a CUDA build's
        for dtype in ALL_DTYPES:
            assert decode_experts_supported(1, 8, dtype, "cuda")
        assert decode_experts_supported(0, 8, torch.float32, torch.device("cuda", 0))
        assert decode_experts_supported(DECODE_MAX_TOKENS, DECODE_MAX_CHOICES // DECODE_MAX_TOKENS, torch.bfloat16)
        assert not decode_experts_supported(DECODE_MAX_TOKENS + 1, 1, torch.bfloat16)
        assert not decode_experts_supported(DECODE_MAX_TOKENS, DECODE_MAX_CHOICES // DECODE_MAX_TOKENS + 1,
                                            torch.bfloat16)
        assert not decode_experts_supported(1, 8, torch.int32)


def test_composite_backend_is_not_supported(monkeypatch):
    monkeypatch.setenv("TUTEL_CUDA_BACKEND", "composite")
    with fake_cuda():
        assert not decode_experts_supported(1, 8, torch.bfloat16)


# ------------------------------------------------------------------------------ bad input --
def small():
    return torch.randn(2, 4), torch.tensor([[0], [1]]), torch.randn(2, 6, 4), torch.randn(2, 4, 3)


def test_no_gradient():
    x, ids, up_w, down_w = small()
    with pytest.raises(RuntimeError, match="no backward"):
        decode_experts(x.requires_grad_(), ids, None, up_w, down_w)
    with pytest.raises(RuntimeError, match="no backward"):
        decode_experts(x.detach(), ids, None, up_w.requires_grad_(), down_w)
    with torch.no_grad():
        assert decode_experts(x, ids, None, up_w, down_w).shape == (2, 4)
    with torch.inference_mode():
        assert decode_experts(x, ids, None, up_w, down_w).shape == (2, 4)


def test_bad_arguments_are_named():
    x, ids, up_w, down_w = small()
    cases = [
        (TypeError, "`x` must be float32", dict(x=x.int())),
        (ValueError, "`x` must be 2-D", dict(x=x[None])),
        (TypeError, "`expert_ids` must be int32 or int64", dict(expert_ids=ids.float())),
        (TypeError, "`expert_ids` must be int32 or int64", dict(expert_ids=ids.short())),
        (ValueError, "`expert_ids` must be \\[T, k\\]", dict(expert_ids=ids[:1])),
        (ValueError, "`weights` must have the shape", dict(weights=torch.rand(2, 2))),
        (TypeError, "`weights` must be float32", dict(weights=torch.ones(2, 1, dtype=torch.int64))),
        (TypeError, "`down_weight` must have x's dtype", dict(down_weight=down_w.double())),
        (ValueError, "`expert_ids` is on meta", dict(expert_ids=ids.to("meta"))),
        (ValueError, "`up_weight` is on meta", dict(up_weight=up_w.to("meta"))),
        (ValueError, "twice the down projection", dict(down_weight=torch.randn(2, 4, 4))),
        (ValueError, "both must hold the same number", dict(down_weight=torch.randn(3, 4, 3))),
        (ValueError, "`up_weight` .* must take the 4 features", dict(up_weight=torch.randn(2, 6, 5))),
        (ValueError, "`down_bias` must be \\[2, 4\\]", dict(down_bias=torch.randn(2, 3))),
        (ValueError, "`gate_weight` must have the shape", dict(gate_weight=torch.randn(2, 3, 4))),
        (ValueError, "not allowed", dict(unit=GatedUnit(limit=-1.0))),
        (TypeError, "`unit` must be", dict(unit="swiglu")),
    ]
    for error, message, change in cases:
        args = dict(x=x, expert_ids=ids, weights=None, up_weight=up_w, down_weight=down_w)
        args.update(change)
        kwargs = {name: args.pop(name) for name in ("down_bias", "gate_weight", "unit") if name in args}
        with pytest.raises(error, match=message):
            decode_experts(*args.values(), **kwargs)


def test_the_operator_checks_its_own_arguments():
    """Direct callers of torch.ops.tutel.decode_experts get the same named errors."""
    x, ids, up_w, down_w = small()

    def call(x=x, ids=ids, up_w=up_w, down_w=down_w, up_bias=None, limit=None, interleaved=False, gate_w=None):
        return torch.ops.tutel.decode_experts(x, ids, None, up_w, down_w, up_bias, None, False, 1.0, 0.0, limit,
                                              interleaved, gate_w)

    assert call().shape == (2, 4)
    with pytest.raises(TypeError, match="decode_experts: `expert_ids` must be int32 or int64"):
        call(ids=ids.to(torch.int16))
    with pytest.raises(ValueError, match="decode_experts: `up_weight` holds 0 experts"):
        call(up_w=torch.randn(0, 6, 4), down_w=torch.randn(0, 4, 3))
    with pytest.raises(ValueError, match="decode_experts: .*twice"):
        call(down_w=torch.randn(2, 4, 4))
    with pytest.raises(ValueError, match="decode_experts: `up_bias` must be \\[2, 6\\]"):
        call(up_bias=torch.randn(2, 5))
    with pytest.raises(ValueError, match="decode_experts: with a separate `gate_weight`"):
        call(gate_w=torch.randn(2, 3, 4), up_w=torch.randn(2, 3, 4), interleaved=True)
    with pytest.raises(ValueError, match="decode_experts: limit must be None or a finite number > 0"):
        call(limit=0.0)
