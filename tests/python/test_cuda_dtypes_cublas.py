"""float16 / float32 / float64 experts on CUDA run on PyTorch's matrix products (cuBLAS: tensor cores,
TF32 where allowed) where PyTorch's grouped_mm has no kernel, and tutel's sync-free grouped kernel
(grouped_rows_linear, CUDA cores) stays for the calls that must not synchronise.

* The chooser (tutel.rules.paths): a static capacity takes Tutel's [E, C, M] slots through the
  experts module (``static_slots``: bmm, no host read, so also under graph capture and
  torch.compile); an eager dropless layer reads its largest load once (``dropless_slots``); eager
  routed experts read their group ends once and run one product per busy expert
  (``experts_per_expert``); under CUDA-graph capture or torch.compile tracing the dropless calls keep
  the grouped kernel (``static_grouped``, ``experts_grouped``).
* Traced on fake CUDA tensors (tests/python/launch_count.py; a host read raises there), for
  moe_layer (Tutel's ffn experts, 4096 tokens), routed experts and transformers' experts through
  "tutel": which operators run, forward and backward.  The one host read of a dropless path cannot
  run on fake tensors: the function that makes it is replaced by one returning what a GPU would read
  (a count the test chooses), and the test counts that it ran once.  So the trace proves the
  operators, the launches and that nothing else reads the device; the values read come from the
  test, and the products' values are checked on the CPU (below).
* Capture is faked for the trace (torch.cuda.is_current_stream_capturing answering True, CUDA marked
  initialised), also after eager calls of the same shapes, whose kept path must not be reused;
  torch.compile traces on CPU tensors (below), with any host read failing the test.
* Each rule, and each condition on capture and tracing, is undone (the rules replaced without it)
  to show the test would see it missing.
* Correctness: the same stages on real CPU tensors (the device fact made "cuda"), against float64
  references, forward and every gradient.
"""
import copy

import pytest
import torch
import torch.nn.functional as F

import tutel.experts.routed as routed_module
from layer_harness import run_and_compare as run_layer_and_compare
from launch_count import OperatorCount, backward_by_hand, fake_cuda, fake_parameters
from test_gates_experts import llama_reference
from test_grouped_experts import make_layer
from test_routed_experts import make_case, run_and_compare as run_routed_and_compare
from tutel import moe
from tutel.experts.routed import routed_experts
from tutel.ops.per_expert_mm import per_expert_mm
from tutel.paths import experts_per_expert, facts, prepare, table
from tutel.rules import paths as path_rules
from tutel.rules.paths import EXPERTS, LAYER, Path, choose_path

CUBLAS_DTYPES = [torch.float16, torch.float32, torch.float64]
KERNEL = "tutel.grouped_rows_linear.default"
KERNEL_BACKWARD = "tutel.grouped_rows_linear_backward.default"
CUBLAS_PRODUCTS = {"aten.mm.default", "aten.mm.out", "aten.addmm.out", "aten.bmm.default", "aten.baddbmm.default"}
LAYER_FORWARD_BUDGET = 12  # test_launch_budget.py's


def _cublas(operators):
    return [op for op in operators if op in CUBLAS_PRODUCTS]


def _without_rules(monkeypatch, *removed: Path) -> None:
    """The chooser without the rules naming `removed` (a new RULES tuple: kept answers are dropped)."""
    monkeypatch.setattr(path_rules, "RULES", tuple(r for r in path_rules.RULES if r.path not in removed))


def _without_condition(monkeypatch, path: Path, fact: str) -> None:
    """The rule naming `path` without its condition on `fact`."""
    monkeypatch.setattr(path_rules, "RULES", tuple(
        rule._replace(when=tuple(c for c in rule.when if c[0] != fact)) if rule.path is path else rule
        for rule in path_rules.RULES))


def _capturing(monkeypatch) -> None:
    """A CUDA graph is being captured, as tutel sees it: CUDA initialised (device 0 current, which
    fake tensors made on "cuda" then ask for), the stream capturing."""
    monkeypatch.setattr(torch.cuda, "_initialized", True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)


class _Reads(list):
    """The host reads made, in order (a list with the answers' settings beside it)."""
    state: dict


@pytest.fixture
def host_reads(monkeypatch):
    """The dropless paths' host reads, answered with counts a GPU could read (fake tensors hold
    none): the largest load (`largest_load`, set by the test) and the group ends (an even split of
    the grouped rows); returns the list of the reads made."""
    reads = _Reads()
    state = {"largest_load": 1}

    def largest_load(dispatch_count):
        reads.append("largest_load")
        return state["largest_load"]

    def group_ends(plan):
        reads.append("group_ends")
        rows, experts = plan.slot_choices.shape[0], plan.offsets.shape[0]
        return [(e + 1) * rows // experts for e in range(experts)]

    monkeypatch.setattr(prepare, "largest_load", largest_load)
    monkeypatch.setattr(experts_per_expert, "group_ends_on_host", group_ends)
    reads.state = state
    return reads


# ------------------------------------------------------------------------------------ the rules

CUDA_LAYER = dict(device="cuda", gradient=True, traced=False, capturing=False, processes="one", layout="padded",
                  tutel_routing=True, gate_at_combine=True, token_dims="one", gated_experts=False,
                  experts_in_pieces=True, experts_grouped=True, rows_fit_one_call=False, decode_kernel=False)


@pytest.mark.parametrize("change, expected", [
    ({"capacity": "static", "cublas_dtype": True}, Path.STATIC_SLOTS),
    ({"capacity": "static", "cublas_dtype": True, "capturing": True}, Path.STATIC_SLOTS),
    ({"capacity": "static", "cublas_dtype": True, "traced": True}, Path.STATIC_SLOTS),
    ({"capacity": "static", "cublas_dtype": False}, Path.STATIC_GROUPED),
    ({"capacity": "dropless", "cublas_dtype": True}, Path.DROPLESS_SLOTS),
    ({"capacity": "dropless", "cublas_dtype": True, "capturing": True}, Path.STATIC_GROUPED),
    ({"capacity": "dropless", "cublas_dtype": True, "traced": True}, Path.STATIC_GROUPED),
    ({"capacity": "dropless", "cublas_dtype": False}, Path.STATIC_GROUPED),
    ({"capacity": "capped", "cublas_dtype": True}, Path.PADDED),
    ({"capacity": "static", "cublas_dtype": True, "tutel_routing": False}, Path.PADDED),
    ({"capacity": "dropless", "cublas_dtype": True, "token_dims": "several"}, Path.PADDED),
    ({"capacity": "dropless", "cublas_dtype": True, "processes": "several"}, Path.EXPERT_PARALLEL),
    ({"capacity": "dropless", "cublas_dtype": True, "device": "cpu"}, Path.PADDED),
])
def test_layer_rules_per_dtype_and_capture(change, expected):
    assert choose_path(LAYER, {**CUDA_LAYER, **change}).path is expected


@pytest.mark.parametrize("change, expected", [
    ({}, Path.EXPERTS_PER_EXPERT),
    ({"gradient": False}, Path.EXPERTS_PER_EXPERT),
    ({"capturing": True}, Path.EXPERTS_GROUPED),
    ({"traced": True}, Path.EXPERTS_GROUPED),
    ({"cublas_dtype": False}, Path.EXPERTS_GROUPED),
    ({"gradient": False, "gated_experts": True, "decode_kernel": True}, Path.EXPERTS_DECODE),
    ({"device": "cpu", "gradient": True}, Path.EXPERTS_GROUPED),
])
def test_experts_rules_per_dtype_and_capture(change, expected):
    facts_of_call = dict(device="cuda", gradient=True, traced=False, capturing=False, cublas_dtype=True,
                         gated_experts=False, rows_fit_one_call=False, decode_kernel=False)
    assert choose_path(EXPERTS, {**facts_of_call, **change}).path is expected


def test_the_facts_name_the_dtype_and_the_capture(monkeypatch):
    """Both entries' facts: cublas_dtype by the tokens' dtype; capturing asked only for CUDA tokens of
    those dtypes (False before CUDA is initialised, where CUDA tensors can only be fake)."""
    with fake_cuda():
        x = torch.randn(4, 8, device="cuda")
        ids = torch.zeros(4, 2, dtype=torch.int64, device="cuda")
        experts = routed_module.WeightExperts(torch.randn(3, 6, 8, device="cuda"), torch.randn(3, 8, 6, device="cuda"),
                                              None, None, False, None, None, torch.tanh, None)
        assert facts.experts_facts(x, ids, None, experts)["cublas_dtype"] is True
        assert facts.experts_facts(x, ids, None, experts)["capturing"] is False
        _capturing(monkeypatch)
        assert facts.experts_facts(x, ids, None, experts)["capturing"] is True
        assert facts.experts_facts(x.bfloat16(), ids, None, experts)["cublas_dtype"] is False
        assert facts.experts_facts(x.bfloat16(), ids, None, experts)["capturing"] is False  # not asked
    assert facts.experts_facts(torch.randn(4, 8), torch.zeros(4, 2, dtype=torch.int64), None,
                               routed_module.WeightExperts(torch.randn(3, 6, 8), torch.randn(3, 8, 6), None, None,
                                                           False, None, None, torch.tanh, None))["capturing"] is False


# ------------------------------------------------------------------------- moe_layer, fake CUDA

def _tutel_layer(mode, dtype, experts=16, hidden=512, model_dim=256):
    """Tutel's own layer: top-2 gate, ffn experts with an activation, as fake CUDA tensors of `dtype`."""
    with torch.device("meta"):
        layer = moe.moe_layer(gate_type={"type": "top", "k": 2}, model_dim=model_dim,
                              experts={"type": "ffn", "count_per_node": experts, "hidden_size_per_expert": hidden,
                                       "activation_fn": lambda x: F.gelu(x)})
    return fake_parameters(layer, mode, dtype=dtype)


def _trace_layer(dtype, capacity_factor, tokens=4096):
    """A training step of the layer on fake CUDA tensors: (path, forward count, backward count)."""
    with fake_cuda() as mode:
        layer = _tutel_layer(mode, dtype)
        x = torch.randn(tokens, layer.model_dim, device="cuda", dtype=dtype, requires_grad=True)
        path = layer.choose_path(x, capacity_factor=capacity_factor).path
        with OperatorCount() as forward:
            y = layer(x, capacity_factor=capacity_factor)
        with OperatorCount() as backward:
            grads = backward_by_hand([y, y.l_aux], [torch.randn_like(y), torch.ones_like(y.l_aux)])
    assert {id(x), *map(id, layer.parameters())} == set(map(id, grads))
    return path, forward, backward


@pytest.mark.parametrize("dtype", CUBLAS_DTYPES, ids=str)
def test_layer_with_a_capacity_multiplies_with_bmm_without_a_host_read(dtype):
    """capacity_factor > 0: Tutel's slots through the experts' baddbmm, nothing read back (a read
    raises on fake tensors), within the layer's budgets."""
    path, forward, backward = _trace_layer(dtype, 1.0)
    assert path is Path.STATIC_SLOTS
    assert _cublas(forward.operators).count("aten.baddbmm.default") == 2, forward.operators
    assert "aten.bmm.default" in backward.operators
    assert KERNEL not in forward.operators and KERNEL_BACKWARD not in backward.operators
    assert forward.kernels <= LAYER_FORWARD_BUDGET, forward.operators
    assert backward.kernels <= 2 * forward.kernels, backward.operators


@pytest.mark.parametrize("dtype", CUBLAS_DTYPES, ids=str)
def test_layer_dropless_reads_the_largest_load_once_then_bmm(host_reads, dtype):
    host_reads.state["largest_load"] = 4096 * 2 // 16 + 37  # an uneven load: any count the GPU could read
    path, forward, backward = _trace_layer(dtype, 0.0)
    assert path is Path.DROPLESS_SLOTS
    assert host_reads == ["largest_load"]
    assert _cublas(forward.operators).count("aten.baddbmm.default") == 2, forward.operators
    assert KERNEL not in forward.operators and KERNEL_BACKWARD not in backward.operators
    assert forward.kernels <= LAYER_FORWARD_BUDGET, forward.operators
    assert backward.kernels <= 2 * forward.kernels, backward.operators


@pytest.mark.parametrize("capacity_factor, rule", [(1.0, Path.STATIC_SLOTS), (0.0, Path.DROPLESS_SLOTS)],
                         ids=["capacity", "dropless"])
def test_undoing_a_layer_rule_brings_the_kernel_back(monkeypatch, host_reads, capacity_factor, rule):
    _without_rules(monkeypatch, rule)
    path, forward, backward = _trace_layer(torch.float32, capacity_factor)
    assert path is Path.STATIC_GROUPED and host_reads == []
    assert forward.operators.count(KERNEL) == 2, forward.operators
    assert _cublas(forward.operators) == ["aten.mm.default"], forward.operators  # the gate's product only
    assert backward.operators.count(KERNEL_BACKWARD) == 2


@pytest.mark.parametrize("dtype", CUBLAS_DTYPES, ids=str)
def test_layer_under_capture(monkeypatch, dtype):
    """Under CUDA-graph capture the dropless layer keeps the grouped kernel (no host read: none is
    answered here, so one would raise); a static capacity keeps bmm, which captures."""
    _capturing(monkeypatch)
    path, forward, backward = _trace_layer(dtype, 0.0)
    assert path is Path.STATIC_GROUPED
    assert forward.operators.count(KERNEL) == 2 and backward.operators.count(KERNEL_BACKWARD) == 2
    path, forward, _ = _trace_layer(dtype, 1.0)
    assert path is Path.STATIC_SLOTS and KERNEL not in forward.operators


def test_undoing_the_capture_condition_reads_the_host_under_capture(monkeypatch):
    """The dropless rule without its `capturing = no`: the captured call reads the largest load back,
    which the fake tensors refuse (as a capture would)."""
    _without_condition(monkeypatch, Path.DROPLESS_SLOTS, "capturing")
    _capturing(monkeypatch)
    with pytest.raises(Exception, match="local_scalar_dense|data-dependent|DataDependent|tolist"):
        _trace_layer(torch.float32, 0.0)


# ------------------------------------------------------------------ routed experts, fake CUDA

def _routed_call(dtype, tokens=512, experts=8, k=2, hidden=64, inter=96, gated=True, biases=False):
    e, h, i = experts, hidden, inter
    make = dict(device="cuda", dtype=dtype, requires_grad=True)
    x = torch.randn(tokens, h, **make)
    ids = torch.randint(0, e, (tokens, k), device="cuda")
    weights = torch.rand(tokens, k, **make)
    up = torch.randn(e, 2 * i if gated else i, h, **make)
    down = torch.randn(e, h, i, **make)
    up_bias = torch.randn(e, up.shape[1], **make) if biases else None
    down_bias = torch.randn(e, h, **make) if biases else None
    leaves = [t for t in (x, weights, up, down, up_bias, down_bias) if t is not None]
    kwargs = dict(gate="swiglu") if gated else dict(activation=torch.tanh)
    return leaves, lambda: routed_experts(x, ids, weights, up, down, up_bias=up_bias, down_bias=down_bias, **kwargs)


def _trace_routed(dtype, **sizes):
    with fake_cuda():
        leaves, call = _routed_call(dtype, **sizes)
        with OperatorCount() as forward:
            y = call()
        with OperatorCount() as backward:
            grads = backward_by_hand(y, torch.randn_like(y))
    assert {id(t): tuple(t.shape) for t in leaves} == {id(t): tuple(g.shape) for t, g in grads.items()}
    return forward, backward


@pytest.mark.parametrize("dtype", CUBLAS_DTYPES, ids=str)
@pytest.mark.parametrize("gated, biases", [(True, False), (False, True)], ids=["swiglu", "biases"])
def test_routed_experts_read_the_ends_once_then_one_product_per_expert(host_reads, dtype, gated, biases):
    """Forward: the plan (2 launches), the rows (1), two products per busy expert, the unit or
    activation (1), the combine (1); backward within twice that; one host read."""
    forward, backward = _trace_routed(dtype, gated=gated, biases=biases)
    experts = 8
    assert host_reads == ["group_ends"]
    assert len(_cublas(forward.operators)) == 2 * experts, forward.operators
    assert set(_cublas(forward.operators)) == ({"aten.addmm.out"} if biases else {"aten.mm.out"})
    assert KERNEL not in forward.operators and KERNEL_BACKWARD not in backward.operators
    assert forward.kernels == 2 * experts + 5, forward.operators
    assert backward.kernels <= 2 * forward.kernels, backward.operators


def test_undoing_the_experts_rule_brings_the_kernel_back(monkeypatch, host_reads):
    _without_rules(monkeypatch, Path.EXPERTS_PER_EXPERT)
    forward, backward = _trace_routed(torch.float32)
    assert host_reads == [] and not _cublas(forward.operators)
    assert forward.operators.count(KERNEL) == 2 and backward.operators.count(KERNEL_BACKWARD) == 2


@pytest.mark.parametrize("dtype", CUBLAS_DTYPES, ids=str)
def test_routed_experts_under_capture_keep_the_sync_free_kernel(monkeypatch, dtype):
    """No host read is answered here: the captured call must make none."""
    _capturing(monkeypatch)
    forward, backward = _trace_routed(dtype)
    assert not _cublas(forward.operators)
    assert forward.operators.count(KERNEL) == 2 and backward.operators.count(KERNEL_BACKWARD) == 2


def test_undoing_the_experts_capture_condition_reads_the_host_under_capture(monkeypatch):
    _without_condition(monkeypatch, Path.EXPERTS_PER_EXPERT, "capturing")
    _capturing(monkeypatch)
    with pytest.raises(Exception, match="local_scalar_dense|data-dependent|DataDependent|tolist"):
        _trace_routed(torch.float32)


@pytest.mark.parametrize("entry", ["routed", "layer"])
def test_capture_after_eager_calls_of_the_same_shapes(monkeypatch, host_reads, entry):
    """The usual CUDA-graph recipe: eager warm-up calls, then the capture of the same call.  The
    captured call must choose again (the capture is a fact), not reuse the eager call's path, which
    reads the host (here: fails the test)."""
    with fake_cuda() as mode, torch.no_grad():
        if entry == "routed":
            _, call = _routed_call(torch.float16)
        else:
            layer = _tutel_layer(mode, torch.float16).eval()
            x = torch.randn(256, layer.model_dim, device="cuda", dtype=torch.float16)
            call = lambda: layer(x, capacity_factor=0.0)  # noqa: E731
        call()
        call()
        assert host_reads, "the eager calls read the host"
        monkeypatch.setattr(prepare, "largest_load", lambda *args: pytest.fail("host read under capture"))
        monkeypatch.setattr(experts_per_expert, "group_ends_on_host",
                            lambda *args: pytest.fail("host read under capture"))
        _capturing(monkeypatch)
        call()  # (no counting mode: it would make the call unlike the warm ones)


# ---------------------------------------------------------------- transformers' experts, fake CUDA

def _transformers_experts(kind: str, experts: int = 8):
    """A transformers experts module with "tutel" as its implementation, built on the meta device."""
    transformers = pytest.importorskip("transformers")
    import tutel.integrations.transformers  # noqa: F401  (registers "tutel")
    sizes = dict(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, num_local_experts=experts,
                 intermediate_size=40)
    config = transformers.MixtralConfig(**sizes) if kind == "mixtral" else transformers.GptOssConfig(**sizes)
    config._experts_implementation = "tutel"
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts
    with torch.device("meta"):
        return (MixtralExperts if kind == "mixtral" else GptOssExperts)(config)


@pytest.mark.parametrize("dtype", CUBLAS_DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["mixtral", "gpt_oss"])
def test_transformers_experts_through_tutel_take_cublas(monkeypatch, host_reads, kind, dtype):
    ours = _transformers_experts(kind)

    def trace():
        with fake_cuda() as mode:
            fake_parameters(ours, mode, dtype=dtype)
            hidden = torch.randn(512, 64, device="cuda", dtype=dtype, requires_grad=True)
            ids = torch.randint(0, 8, (512, 2), device="cuda")
            weights = torch.rand(512, 2, device="cuda", dtype=dtype, requires_grad=True)
            with OperatorCount() as forward:
                y = ours(hidden, ids, weights)
            with OperatorCount() as backward:
                backward_by_hand(y, torch.randn_like(y))
        return forward, backward

    forward, backward = trace()
    assert host_reads == ["group_ends"]
    assert len(_cublas(forward.operators)) == 16 and KERNEL not in forward.operators, forward.operators
    assert KERNEL_BACKWARD not in backward.operators
    assert backward.kernels <= 2 * forward.kernels, backward.operators
    _without_rules(monkeypatch, Path.EXPERTS_PER_EXPERT)
    forward, _ = trace()
    assert forward.operators.count(KERNEL) == 2 and not _cublas(forward.operators)


# ------------------------------------------------------------------------------ torch.compile

@pytest.fixture
def cuda_facts_on_cpu(monkeypatch):
    """CPU tensors described as CUDA ones to the chooser: the CUDA rules' stages run on real CPU
    tensors (whose results can be compared), reading the host as a GPU call would.  Returns the
    paths table.run ran."""
    monkeypatch.setitem(facts._DEVICE_KINDS, "cpu", "cuda")
    monkeypatch.setattr(path_rules, "RULES", tuple(list(path_rules.RULES)))  # a new tuple: nothing kept applies
    taken = []
    original = table.run

    def spy(path, work):
        taken.append(path)
        return original(path, work)

    monkeypatch.setattr(routed_module, "run", spy)
    import tutel.impls.layer_paths as layer_paths
    monkeypatch.setattr(layer_paths, "run", spy)
    return taken


def test_compiled_routed_experts_keep_the_sync_free_products(monkeypatch, cuda_facts_on_cpu):
    """torch.compile traces the grouped products (one opaque operator); the eager call takes one
    product per expert.  Forward and every gradient equal eager's."""
    x, ids, weights, up, down, ub, db = make_case(10, 16, 8, 16, 4, 2, True, False, True, True, torch.float64, 9)
    leaves = [x, weights, up, down, ub, db]

    def step(x, ids, weights, up, down, ub, db):
        return routed_experts(x, ids, weights, up, down, up_bias=ub, down_bias=db, gate="swiglu")

    eager = step(x, ids, *leaves[1:])
    assert cuda_facts_on_cpu == [Path.EXPERTS_PER_EXPERT]
    eager_grads = torch.autograd.grad(eager.square().sum(), leaves)
    monkeypatch.setattr(experts_per_expert, "group_ends_on_host",
                        lambda plan: pytest.fail("a host read while torch.compile traces"))
    got = torch.compile(step, fullgraph=True, backend="aot_eager")(x, ids, *leaves[1:])
    assert cuda_facts_on_cpu[1:] == [Path.EXPERTS_GROUPED]  # (the spy traced with the call)
    got_grads = torch.autograd.grad(got.square().sum(), leaves)
    torch.testing.assert_close(got, eager)
    for g, w in zip(got_grads, eager_grads):
        torch.testing.assert_close(g, w)


# ------------------------------------------------------------------- correctness on the CPU

@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("gated, bias", [(True, False), (False, True), (True, True)])
def test_routed_experts_per_expert_match_the_reference(cuda_facts_on_cpu, dtype, transposed, gated, bias):
    """Forward and every gradient against the float64 loop, with ids outside [0, E) (sentinels)."""
    case = make_case(23, 12, 7, 9, 5, 3, gated, transposed, bias, True, dtype, 5)
    run_routed_and_compare(case, transposed, gated, dtype)
    assert cuda_facts_on_cpu == [Path.EXPERTS_PER_EXPERT]


@pytest.mark.parametrize("tokens, experts, k", [(0, 4, 2), (1, 6, 2), (3, 16, 1), (40, 3, 3)])
def test_routed_experts_per_expert_idle_experts_and_empty_calls(cuda_facts_on_cpu, tokens, experts, k):
    case = make_case(tokens, 8, 5, 6, experts, k, True, False, True, False, torch.float64, tokens + experts)
    run_routed_and_compare(case, False, True, torch.float64)
    assert cuda_facts_on_cpu == [Path.EXPERTS_PER_EXPERT]


@pytest.mark.parametrize("expert_type", ["ffn", "llama_ffn"])
@pytest.mark.parametrize("capacity_factor, is_postscore, batch_prioritized", [
    (0.0, True, False), (0.0, False, False), (0.5, True, True), (2.0, False, False), (1.0, True, False)])
@pytest.mark.parametrize("experts, k, tokens", [(7, 3, 37), (3, 1, 1), (16, 2, 29), (5, 2, 0)])
def test_layer_slots_match_the_reference(cuda_facts_on_cpu, expert_type, capacity_factor, is_postscore,
                                         batch_prioritized, experts, k, tokens):
    """static_slots (capacities that drop included) and dropless_slots: output, l_aux and every
    gradient against the float64 token-by-token reference."""
    torch.manual_seed(experts + 10 * tokens + k)
    layer = make_layer(experts, k, capacity_factor, hidden=11, expert_type=expert_type,
                       batch_prioritized_routing=batch_prioritized, is_postscore=is_postscore)
    for param in layer.parameters():  # random biases, so their gradients count
        with torch.no_grad():
            param.copy_(torch.randn_like(param) * 0.5)
    reference = dict(expert_reference=llama_reference) if expert_type == "llama_ffn" else {}
    _, kept = run_layer_and_compare(
        layer, torch.randn(tokens, 10, dtype=torch.float64), top_k=k, capacity_factor=capacity_factor,
        batch_prioritized=batch_prioritized, is_postscore=is_postscore,
        **({"activation": torch.relu} if expert_type == "ffn" else {}), **reference)
    assert cuda_facts_on_cpu == [Path.DROPLESS_SLOTS if capacity_factor == 0 else Path.STATIC_SLOTS]
    if capacity_factor == 0.5 and tokens == 37:
        assert not bool(kept.all()), "the case must drop choices"


def test_layer_slots_in_float32_match_the_reference(cuda_facts_on_cpu):
    torch.manual_seed(3)
    for capacity_factor in (0.0, 1.0):
        layer = make_layer(6, 2, capacity_factor, hidden=13, expert_type="ffn").float()
        run_layer_and_compare(layer, torch.randn(31, 10), top_k=2, capacity_factor=capacity_factor,
                              activation=torch.relu, tol=dict(rtol=1e-4, atol=1e-4))
    assert cuda_facts_on_cpu == [Path.DROPLESS_SLOTS, Path.STATIC_SLOTS]


def test_largest_load_is_the_largest_count():
    assert prepare.largest_load(torch.tensor([3, 0, 9, 2])) == 9
    assert prepare.largest_load(torch.zeros(0, dtype=torch.int64)) == 0


@pytest.mark.parametrize("kind", ["mixtral", "gpt_oss"])
def test_transformers_experts_per_expert_match_their_own_forward(cuda_facts_on_cpu, kind):
    """The model's own eager experts are the reference, in float64, forward and gradients."""
    transformers = pytest.importorskip("transformers")
    import tutel.integrations.transformers  # noqa: F401
    sizes = dict(hidden_size=12, num_attention_heads=2, num_key_value_heads=1, num_local_experts=5,
                 intermediate_size=7)
    config = transformers.MixtralConfig(**sizes) if kind == "mixtral" else \
        transformers.GptOssConfig(**sizes, swiglu_limit=1.5)
    config._experts_implementation = "eager"
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts
    eager = (MixtralExperts if kind == "mixtral" else GptOssExperts)(config)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in eager.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator, dtype=torch.float64) * 0.5)
    eager = eager.double()
    ours = copy.deepcopy(eager)
    ours.config = copy.deepcopy(config)
    ours.config._experts_implementation = "tutel"
    hidden = torch.randn(19, 12, generator=generator, dtype=torch.float64, requires_grad=True)
    ids = torch.rand(19, 5, generator=generator).topk(2, dim=1).indices
    weights = torch.rand(19, 2, generator=generator, dtype=torch.float64, requires_grad=True)
    want = eager(hidden, ids, weights)
    got = ours(hidden, ids, weights)
    assert cuda_facts_on_cpu == [Path.EXPERTS_PER_EXPERT]
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    seed = torch.randn(want.shape, generator=generator, dtype=torch.float64)
    want_grads = torch.autograd.grad(want, [hidden, weights, *eager.parameters()], seed)
    got_grads = torch.autograd.grad(got, [hidden, weights, *ours.parameters()], seed)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)


# ------------------------------------------------------------------------- per_expert_mm itself

def _reference_products(rows, weight, ends, transposed, bias):
    """Row by row in float64: row i times its expert's matrix (+ bias), zero past the last end;
    ends read as their running maximum clamped to [0, N]."""
    out = torch.zeros(rows.shape[0], weight.shape[2] if transposed else weight.shape[1], dtype=torch.float64)
    begin = 0
    for expert, end in enumerate(ends):
        end = min(max(end, begin), rows.shape[0])
        for i in range(begin, end):
            w = weight[expert].double()
            out[i] = rows[i].double() @ (w if transposed else w.t())
            if bias is not None:
                out[i] = out[i] + bias[expert].double()
        begin = end
    return out


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("with_bias, with_offsets", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("ends", [[3, 3, 20, 25], [0, 0, 0, 0], [29, 29, 29, 29], [5, 2, 40, -1], [0, 7, 7, 29]])
def test_per_expert_mm_matches_the_reference(dtype, transposed, with_bias, with_offsets, ends):
    """Idle experts, a tail past the last end (zero, and a zero gradient), ends out of order or out of
    range; forward and the gradients of rows, weight and bias."""
    gen = torch.Generator().manual_seed(len(ends) + sum(ends))
    rows = torch.randn(29, 7, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()
    weight = (torch.randn(*((4, 7, 5) if transposed else (4, 5, 7)), generator=gen, dtype=torch.float64) * 0.4
              ).to(dtype).requires_grad_()
    bias = torch.randn(4, 5, generator=gen, dtype=torch.float64).to(dtype).requires_grad_() if with_bias else None
    clamped, running = [], 0
    for end in ends:
        running = min(max(end, running), 29)
        clamped.append(running)
    offsets = torch.tensor(clamped, dtype=torch.int32) if with_offsets else None
    out = per_expert_mm(rows, weight, ends, transposed, bias, offsets=offsets)
    leaves = [t for t in (rows, weight, bias) if t is not None]
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    want = _reference_products(ref_leaves[0], ref_leaves[1], ends, transposed,
                               ref_leaves[2] if with_bias else None)
    tol = {torch.float64: dict(rtol=1e-12, atol=1e-12), torch.float32: dict(rtol=1e-5, atol=1e-5),
           torch.float16: dict(rtol=4e-3, atol=4e-3)}[dtype]
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), want, **tol)
    seed = torch.randn(want.shape, generator=gen, dtype=torch.float64)
    got = torch.autograd.grad(out, leaves, seed.to(dtype))
    expected = torch.autograd.grad(want, ref_leaves, seed, allow_unused=True) if want.requires_grad else \
        [None] * len(ref_leaves)
    expected = [torch.zeros_like(leaf) if w is None else w for w, leaf in zip(expected, ref_leaves)]
    for g, w in zip(got, expected):
        scale = max(1.0, float(w.abs().max()))  # a gradient sums many terms: its size sets the rounding
        torch.testing.assert_close(g.double(), w, rtol=tol["rtol"] * 4, atol=tol["atol"] * 4 * scale)


def test_per_expert_mm_without_zero_tail_writes_the_groups_only():
    """zero_tail=False: the groups' rows are the products (the tail is left as it is)."""
    rows, weight = torch.randn(9, 3, dtype=torch.float64), torch.randn(2, 4, 3, dtype=torch.float64)
    out = per_expert_mm(rows, weight, [2, 6], zero_tail=False)
    torch.testing.assert_close(out[:6], _reference_products(rows, weight, [2, 6], False, None)[:6])


def test_compiled_dropless_layer_keeps_the_sync_free_products(monkeypatch, cuda_facts_on_cpu):
    """torch.compile traces the dropless layer on the static grouped path (no host read), the eager
    call reads the largest load; forward, l_aux and every gradient equal eager's."""
    torch.manual_seed(5)
    layer = make_layer(6, 2, 0.0, hidden=11, expert_type="llama_ffn")
    x = torch.randn(23, 10, dtype=torch.float64, requires_grad=True)
    params = [x, *layer.parameters()]
    eager = layer(x)
    assert cuda_facts_on_cpu == [Path.DROPLESS_SLOTS]
    want = torch.autograd.grad(eager.square().sum() + eager.l_aux, params)
    monkeypatch.setattr(prepare, "largest_load", lambda *args: pytest.fail("a host read while torch.compile traces"))
    compiled = torch.compile(layer, backend="aot_eager")
    got = compiled(x)
    assert cuda_facts_on_cpu[1:] == [Path.STATIC_GROUPED]  # (the spy traced with the call)
    torch.testing.assert_close(got, eager)
    torch.testing.assert_close(got.l_aux, eager.l_aux)
    for g, w in zip(torch.autograd.grad(got.square().sum() + got.l_aux, params), want):
        torch.testing.assert_close(g, w)


def test_undoing_the_traced_conditions_reads_the_host_while_compiling(monkeypatch, cuda_facts_on_cpu):
    """Without `traced = no` the compiled calls take the paths that read the host (here: raise)."""
    def host_read(*args):
        raise RuntimeError("a host read while torch.compile traces")

    monkeypatch.setattr(prepare, "largest_load", host_read)
    monkeypatch.setattr(experts_per_expert, "group_ends_on_host", host_read)
    _without_condition(monkeypatch, Path.EXPERTS_PER_EXPERT, "traced")
    _without_condition(monkeypatch, Path.DROPLESS_SLOTS, "traced")
    x, ids, weights, up, down, _, _ = make_case(10, 16, 8, 16, 4, 2, True, False, False, False, torch.float64, 9)
    with pytest.raises(Exception, match="host read"):
        torch.compile(lambda *a: routed_experts(*a, gate="swiglu"), fullgraph=True, backend="aot_eager")(
            x, ids, weights, up, down)
    layer = make_layer(6, 2, 0.0, hidden=11, expert_type="llama_ffn")
    with pytest.raises(Exception, match="host read"):
        torch.compile(layer, backend="aot_eager")(torch.randn(23, 10, dtype=torch.float64))
