"""The routed experts and moe_layer on a CUDA device launch few kernels and never wait for the host.

Traced on fake CUDA tensors (tests/python/launch_count.py): a host synchronisation or a
data-dependent shape raises there, exactly what would break CUDA-graph capture, and the
operators the call dispatches (weighted by their CUDA launches) are counted.  The budgets are the
project's: routed experts at most 8 kernels per forward call at any token count, moe_layer at most
12 including its routing and loss, backward at most twice its forward.  The layers are shaped like
the published models' (sizes cost nothing on fake tensors); the CPU-only PyTorch of CI takes the
CUDA build's path through the operators' fake kernels.
"""
from typing import NamedTuple

import pytest
import torch

import tutel.ops.backend as backend
import tutel.ops.gated_units as gated_units
from tutel import moe
from tutel.experts.routed import routed_experts
from tutel.impls.call_settings import resolve_switches
from tutel.impls.layer_paths import run_path
from tutel.ops.gated_units import GatedUnit
from tutel.rules.paths import Path

from launch_count import OperatorCount, backward_by_hand, fake_cuda, fake_parameters, recording_function_arguments

EXPERTS_FORWARD_BUDGET = 8


class Family(NamedTuple):
    name: str
    experts: int
    k: int
    hidden: int
    intermediate: int
    gate: object
    transposed: bool = False
    biases: bool = False


FAMILIES = [
    Family("qwen3-30b-a3b", 128, 8, 2048, 768, "swiglu"),
    Family("mixtral-8x7b", 8, 2, 4096, 14336, "swiglu"),
    Family("deepseek-v3", 256, 8, 7168, 2048, "swiglu"),
    Family("gpt-oss-20b", 32, 4, 2880, 2880, GatedUnit(1.702, 1.0, 7.0, interleaved=True), True, True),
]
TOKENS = (1, 16, 2048)


def _call(family: Family, tokens: int, grad: bool, dtype=torch.bfloat16):
    """Makes a family's experts and tokens as fake CUDA tensors and returns (inputs, call)."""
    e, h, i = family.experts, family.hidden, family.intermediate
    up_shape, down_shape = ((e, h, 2 * i), (e, i, h)) if family.transposed else ((e, 2 * i, h), (e, h, i))
    make = dict(device="cuda", dtype=dtype, requires_grad=grad)
    x = torch.randn(tokens, h, **make)
    ids = torch.randint(0, e, (tokens, family.k), device="cuda")
    weights = torch.rand(tokens, family.k, **make)
    up, down = torch.randn(up_shape, **make), torch.randn(down_shape, **make)
    up_bias = torch.randn(e, 2 * i, **make) if family.biases else None
    down_bias = torch.randn(e, h, **make) if family.biases else None

    def call() -> torch.Tensor:
        return routed_experts(x, ids, weights, up, down, up_bias=up_bias, down_bias=down_bias,
                              transposed=family.transposed, gate=family.gate)

    leaves = [t for t in (x, weights, up, down, up_bias, down_bias) if t is not None]
    return leaves, call


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
@pytest.mark.parametrize("tokens", TOKENS)
def test_routed_experts_forward_stays_within_the_budget(family, tokens):
    with fake_cuda():
        _, call = _call(family, tokens, grad=False)
        with OperatorCount() as count:
            y = call()
    assert y.shape == (tokens, family.hidden) and y.device.type == "cuda"
    assert count.kernels <= EXPERTS_FORWARD_BUDGET, count.operators




@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
@pytest.mark.parametrize("tokens", TOKENS)
def test_routed_experts_training_step_stays_within_the_budget(family, tokens):
    with fake_cuda():
        leaves, call = _call(family, tokens, grad=True)
        with OperatorCount() as forward:
            y = call()
        seed = torch.randn_like(y)
        with OperatorCount() as backward:
            grads = backward_by_hand(y, seed)
    assert forward.kernels <= EXPERTS_FORWARD_BUDGET, forward.operators
    assert backward.kernels <= 2 * forward.kernels, backward.operators
    # every input, bias included, gets its gradient, of its own shape
    assert {id(t): tuple(t.shape) for t in leaves} == {id(t): tuple(g.shape) for t, g in grads.items()}


def _capturing(monkeypatch):
    """A CUDA graph being captured, as tutel sees it (CUDA initialised, device 0, the stream capturing)."""
    monkeypatch.setattr(torch.cuda, "_initialized", True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_routed_experts_without_a_grouped_mm_kernel_train_within_the_budget(monkeypatch, family, dtype):
    """float32 and float16, which PyTorch's grouped_mm has no kernel for, under CUDA-graph capture
    (eager calls read the group ends and take cuBLAS: test_cuda_dtypes_cublas.py): tutel's grouped
    products (the bias inside) keep the training step free of host reads and within the budgets."""
    _capturing(monkeypatch)
    with fake_cuda():
        leaves, call = _call(family, 16, grad=True, dtype=dtype)
        with OperatorCount() as forward:
            y = call()
        seed = torch.randn_like(y)
        with OperatorCount() as backward:
            grads = backward_by_hand(y, seed)
    assert forward.operators.count("tutel.grouped_rows_linear.default") == 2, forward.operators
    assert backward.operators.count("tutel.grouped_rows_linear_backward.default") == 2, backward.operators
    assert forward.kernels <= EXPERTS_FORWARD_BUDGET, forward.operators
    assert backward.kernels <= 2 * forward.kernels, backward.operators
    assert {id(t): tuple(t.shape) for t in leaves} == {id(t): tuple(g.shape) for t, g in grads.items()}


@pytest.mark.parametrize("family", [FAMILIES[0], FAMILIES[3]], ids=lambda f: f.name)
def test_undoing_the_gated_unit_fusion_breaks_the_budget(monkeypatch, family):
    """The count sees a fusion undone: the gated unit composed of PyTorch operators (as on devices
    without tutel's kernel) costs launches, and takes gpt-oss' call (its clamps, offset and bias
    composed too) past the budget."""
    with fake_cuda():
        _, call = _call(family, 2048, grad=False)  # past the decode kernels' sizes: the grouped path
        with OperatorCount() as fused:
            call()
        # the unit's module sees the composite operators, as on a device without tutel's kernels
        monkeypatch.setattr(gated_units, "operators_for", lambda device: backend.composite)
        with OperatorCount() as composed:
            call()
    assert "tutel.gated_unit.default" in fused.operators
    assert "tutel.gated_unit.default" not in composed.operators
    assert composed.kernels > fused.kernels
    if family.biases:
        assert composed.kernels > EXPERTS_FORWARD_BUDGET >= fused.kernels


def test_a_host_read_raises_on_fake_cuda_tensors():
    """The fake CUDA mode is strict: reading a value back (what breaks graph capture) raises."""
    with fake_cuda():
        counts = torch.zeros(4, dtype=torch.int64, device="cuda")
        with pytest.raises(Exception):
            int(counts.max())
        with pytest.raises(Exception):
            counts.tolist()


def test_backward_by_hand_equals_the_autograd_engine():
    """The walk of the graph the count tests use gives the engine's gradients (CPU, float64)."""
    torch.manual_seed(3)
    family = Family("small", 5, 3, 12, 7, GatedUnit(1.702, 1.0, 7.0, interleaved=True), True, True)
    e, h, i = family.experts, family.hidden, family.intermediate
    make = dict(dtype=torch.float64, requires_grad=True)
    x, weights = torch.randn(9, h, **make), torch.rand(9, family.k, **make)
    up, down = torch.randn(e, h, 2 * i, **make), torch.randn(e, i, h, **make)
    up_bias, down_bias = torch.randn(e, 2 * i, **make), torch.randn(e, h, **make)
    ids = torch.randint(0, e, (9, family.k))
    leaves = (x, weights, up, down, up_bias, down_bias)
    with recording_function_arguments():
        y = routed_experts(x, ids, weights, up, down, up_bias=up_bias, down_bias=down_bias, transposed=True,
                           gate=family.gate)
    seed = torch.randn_like(y)
    expected = torch.autograd.grad(y, leaves, seed, retain_graph=True)
    walked = backward_by_hand(y, seed)
    for leaf, want in zip(leaves, expected):
        torch.testing.assert_close(walked[leaf], want, rtol=1e-12, atol=1e-12)


LAYER_FORWARD_BUDGET = 12


class LayerFamily(NamedTuple):
    name: str
    experts: int
    k: int
    model_dim: int
    hidden: int
    expert_type: str


LAYER_FAMILIES = [
    LayerFamily("qwen3-30b-a3b", 128, 8, 2048, 768, "llama_ffn"),
    LayerFamily("mixtral-8x7b", 8, 2, 4096, 14336, "llama_ffn"),
    LayerFamily("deepseek-v3", 256, 8, 7168, 2048, "llama_ffn"),
    # Tutel's own experts (two products with biases and a ReLU), at gpt-oss-20b's sizes.
    LayerFamily("ffn-gpt-oss-20b", 32, 4, 2880, 2880, "ffn"),
]


def _layer(family: LayerFamily, capacity_factor: float, mode, dtype: torch.dtype = torch.bfloat16):
    """moe_layer of the family's shape, built on the meta device (no memory) and made fake CUDA
    tensors of `dtype`."""
    with torch.device("meta"):
        layer = moe.moe_layer(gate_type={"type": "top", "k": family.k, "capacity_factor": capacity_factor},
                              model_dim=family.model_dim,
                              experts={"type": family.expert_type, "num_experts_per_device": family.experts,
                                       "hidden_size_per_expert": family.hidden})
    return fake_parameters(layer, mode, dtype=dtype)


@pytest.mark.parametrize("family", LAYER_FAMILIES, ids=lambda f: f.name)
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("capacity_factor", [0.0, 1.0], ids=["dropless", "capacity"])
def test_moe_layer_training_step_has_no_host_sync_and_stays_within_the_budget(family, tokens, capacity_factor):
    """Routing, loss, experts and combine, forward and backward, on the static grouped path: no host
    synchronisation (dropless included), at most 12 kernels forward and twice that backward."""
    with fake_cuda() as mode:
        layer = _layer(family, capacity_factor, mode)
        x = torch.randn(tokens, family.model_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        assert layer.choose_path(x).path is Path.STATIC_GROUPED
        with OperatorCount() as forward:
            y = layer(x)
        seeds = [torch.randn_like(y), torch.ones_like(y.l_aux)]
        with OperatorCount() as backward:
            grads = backward_by_hand([y, y.l_aux], seeds)
    assert forward.kernels <= LAYER_FORWARD_BUDGET, forward.operators
    assert backward.kernels <= 2 * forward.kernels, backward.operators
    expected = {id(x): tuple(x.shape), **{id(p): tuple(p.shape) for p in layer.parameters()}}
    assert expected == {id(t): tuple(g.shape) for t, g in grads.items()}


@pytest.mark.parametrize("family", LAYER_FAMILIES, ids=lambda f: f.name)
@pytest.mark.parametrize("capacity_factor", [0.0, 1.0], ids=["dropless", "capacity"])
def test_moe_layer_in_float32_trains_without_a_host_sync(monkeypatch, family, capacity_factor):
    """A float32 layer (no grouped_mm kernel) under CUDA-graph capture: dropless, tutel's grouped
    products; with a capacity, Tutel's slots through the experts' bmm (no host read either way); the
    same budgets."""
    _capturing(monkeypatch)
    with fake_cuda() as mode:
        layer = _layer(family, capacity_factor, mode, dtype=torch.float32)
        x = torch.randn(16, family.model_dim, device="cuda", dtype=torch.float32, requires_grad=True)
        assert layer.choose_path(x).path is (Path.STATIC_GROUPED if capacity_factor == 0 else Path.STATIC_SLOTS)
        with OperatorCount() as forward:
            y = layer(x)
        seeds = [torch.randn_like(y), torch.ones_like(y.l_aux)]
        with OperatorCount() as backward:
            backward_by_hand([y, y.l_aux], seeds)
    products = "tutel.grouped_rows_linear.default" if capacity_factor == 0 else \
        ("aten.bmm.default" if family.expert_type == "llama_ffn" else "aten.baddbmm.default")
    assert products in forward.operators, forward.operators
    assert forward.kernels <= LAYER_FORWARD_BUDGET, forward.operators
    assert backward.kernels <= 2 * forward.kernels, backward.operators


@pytest.fixture
def kernel_limits_only():
    """No measured decode line in effect, whatever line tutel ships for the device a fake CUDA
    tensor stands for (tutel.ops.decode_lines): the decode kernel takes every call within its own
    limits."""
    from tutel.ops.decode_lines import lines_in_effect
    with lines_in_effect([]):
        yield


@pytest.mark.parametrize("family", LAYER_FAMILIES, ids=lambda f: f.name)
@pytest.mark.parametrize("tokens", TOKENS)
def test_moe_layer_decode_step_has_no_host_sync(kernel_limits_only, family, tokens):
    """Inference (no autograd) of the dropless layer traces too, within the budget; at decoding sizes
    the gate's product, the routing and the decode kernels are all it launches (SwiGLU experts)."""
    with fake_cuda() as mode, torch.no_grad():
        layer = _layer(family, 0.0, mode).eval()
        x = torch.randn(tokens, family.model_dim, device="cuda", dtype=torch.bfloat16)
        path = layer.choose_path(x).path
        with OperatorCount() as forward:
            y = layer(x)
    assert y.shape == (tokens, family.model_dim)
    assert forward.kernels <= LAYER_FORWARD_BUDGET, forward.operators
    if tokens <= 32 and family.expert_type == "llama_ffn":
        assert path is Path.STATIC_DECODE
        assert forward.operators == ["aten.mm.default", "tutel.route_experts.default", "tutel.decode_experts.default"]
    else:
        assert path is Path.STATIC_GROUPED


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
@pytest.mark.parametrize("tokens", [1, 16, 32, 33])
def test_routed_experts_at_decoding_sizes_take_the_decode_kernels(kernel_limits_only, family, tokens):
    """Inference of up to 32 tokens (256 choices) is one decode_experts call (two kernels): each
    chosen expert's matrices read once; past that the grouped path."""
    with fake_cuda():
        _, call = _call(family, tokens, grad=False)
        with OperatorCount() as count:
            call()
    if tokens * family.k <= 256 and tokens <= 32:
        assert count.operators == ["tutel.decode_experts.default"]
    else:
        assert "tutel.decode_experts.default" not in count.operators and count.kernels > 2


@pytest.fixture
def measured_line(monkeypatch):
    """A measured decode line of 1 row per expert for bfloat16 on a capability-9.0 GPU, which every
    CUDA device reports here (a real GPU running the tests included)."""
    import tutel.ops.decode_lines as decode_lines
    monkeypatch.setattr(decode_lines, "device_capability", lambda device: "9.0")
    line = decode_lines.DecodeLine("9.0", "bfloat16", 1.0, "a GPU", "a run")
    with decode_lines.lines_in_effect([line]):
        yield


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_routed_experts_hand_over_to_the_grouped_path_at_the_measured_line(measured_line, family):
    """Past T k / E = 1 row per expert the grouped path runs, within it the decode kernel."""
    last = family.experts // family.k  # the largest T with T k <= E
    for tokens in (1, last, last + 1):
        with fake_cuda():
            _, call = _call(family, tokens, grad=False)
            with OperatorCount() as count:
                call()
        within = tokens * family.k <= family.experts and tokens <= 32 and tokens * family.k <= 256
        assert (count.operators == ["tutel.decode_experts.default"]) == within, (tokens, count.operators)


@pytest.mark.parametrize("family", LAYER_FAMILIES[:3], ids=lambda f: f.name)
def test_moe_layer_hands_over_to_the_grouped_path_at_the_measured_line(measured_line, family):
    """The layer's chooser applies the line with its global expert count."""
    last = min(family.experts // family.k, 32)
    with fake_cuda() as mode, torch.no_grad():
        layer = _layer(family, 0.0, mode).eval()
        paths = [layer.choose_path(torch.randn(t, family.model_dim, device="cuda", dtype=torch.bfloat16)).path
                 for t in (last, last + 1)]
    assert paths == [Path.STATIC_DECODE, Path.STATIC_GROUPED]


def test_the_padded_path_reads_the_largest_load_back():
    """What the static grouped path avoids: Tutel's padded dropless path sizes its [E, C, M] buffer
    from the largest load, a host read, which the fake CUDA mode refuses (as graph capture would)."""
    family = LAYER_FAMILIES[1]
    with fake_cuda() as mode:
        layer = _layer(family, 0.0, mode)
        x = torch.randn(16, family.model_dim, device="cuda", dtype=torch.bfloat16)
        with pytest.raises(Exception, match="local_scalar_dense|data-dependent|DataDependent"):
            run_path(Path.PADDED, layer, x, resolve_switches(layer, "test", tokens=16), x.shape[-1:], 16, False)


@pytest.fixture
def two_fake_processes():
    """A process group of two "processes" whose collectives do nothing (PyTorch's fake backend):
    enough to trace a layer whose experts are spread over processes."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    if not torch._C._dispatch_has_kernel_for_dispatch_key("c10d::alltoall_base_", "Meta"):
        pytest.skip(f"needs fake (Meta) kernels of the c10d collectives to trace them on fake tensors, which "
                    f"torch {torch.__version__} lacks")
    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_expert_parallel_layer_with_a_static_capacity_has_no_host_sync(two_fake_processes, monkeypatch):
    """Experts over two processes with capacity_factor > 0: the call's agreement on the capacity
    goes through host integers (a CPU collective), the rest reads nothing back, forward and
    backward.  The agreement runs outside the fake mode here, on real CPU tensors: had it gone
    through the device, the CPU-only PyTorch would refuse to make its CUDA tensor."""
    import tutel.paths.call_agreement as call_agreement
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    real, agreed = call_agreement.all_reduce_max_ints, []

    def on_the_host(values, group=None, device=None):
        with unset_fake_temporarily():
            agreed.append(real(values, group, device))
        return agreed[-1]
    monkeypatch.setattr(call_agreement, "all_reduce_max_ints", on_the_host)
    layer = moe.moe_layer(gate_type={"type": "top", "k": 2, "capacity_factor": 1.0}, model_dim=64,
                          experts={"type": "llama_ffn", "num_experts_per_device": 4, "hidden_size_per_expert": 32})
    with fake_cuda() as mode:
        layer = fake_parameters(layer, mode, dtype=torch.bfloat16)
        x = torch.randn(16, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        assert layer.choose_path(x).path is Path.EXPERT_PARALLEL
        y = layer(x)
        grads = backward_by_hand([y, y.l_aux], [torch.randn_like(y), torch.ones_like(y.l_aux)])
    assert agreed == [[2 * 2, 1, -1, 1, -1]]  # k * ceil(16 / 8 experts), overlap 1, adaptive_r 1
    assert {id(x), *(id(p) for p in layer.parameters())} == set(map(id, grads))


def test_undoing_a_fusion_breaks_the_layer_budget(monkeypatch):
    """The layer's training step with the gated unit of its llama_ffn experts composed of PyTorch
    operators: its backward no longer fits twice its forward."""
    family = LAYER_FAMILIES[0]
    monkeypatch.setattr(gated_units, "fused_unit_on", lambda device, operator="gated_unit": False)
    with fake_cuda() as mode:
        layer = _layer(family, 0.0, mode)
        x = torch.randn(16, family.model_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        with OperatorCount() as forward:
            y = layer(x)
        seeds = [torch.randn_like(y), torch.ones_like(y.l_aux)]
        with OperatorCount() as backward:
            backward_by_hand([y, y.l_aux], seeds)
    assert "tutel.gated_unit_pair.default" not in forward.operators
    assert not (forward.kernels <= LAYER_FORWARD_BUDGET and backward.kernels <= 2 * forward.kernels)
