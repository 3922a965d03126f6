"""The "tutel" experts forward's per-module layout (module_experts.py): every layout against the
class's own eager forward in float64, the path the chooser picks for it, and the kept layout following
every change of the module (read once while the module is unchanged, never keeping replaced weights
alive, copies and pickles reading their own)."""
import copy
import gc
import pickle
import weakref

import pytest
import torch

from transformers_test_setup import one_intra_op_thread  # noqa: F401  (autouse fixture)

pytest.importorskip("transformers")
import tutel.integrations.transformers.module_experts as module_experts  # noqa: E402
from tutel.experts import routed  # noqa: E402
from tutel.rules.paths import Path  # noqa: E402

from tiny_transformers_experts import CASES, E, make_inputs, make_pair  # noqa: E402

EXACT = dict(rtol=1e-10, atol=1e-10)
ONE_CALL = ("mixtral", "gpt_oss", "aria")  # SwiGLU, gpt-oss' clamped interleaved unit, transposed SwiGLU


def _eager(module, *inputs):
    with torch.no_grad():
        return module(*inputs)


@pytest.fixture
def paths_taken(monkeypatch):
    """The paths routed experts run (tutel.paths.run spied on)."""
    taken = []
    original = routed.run

    def spy(path, work):
        taken.append(path)
        return original(path, work)
    monkeypatch.setattr(routed, "run", spy)
    return taken


@pytest.fixture
def layout_reads(monkeypatch):
    """Counts the reads of a module's layout."""
    reads = []
    original = module_experts.read_layout

    def counted(module):
        reads.append(type(module).__name__)
        return original(module)
    monkeypatch.setattr(module_experts, "read_layout", counted)
    return reads


@pytest.mark.parametrize("tokens,k", [(13, 3), (1, 2), (1, 1), (0, 2), (6, 5)])
@pytest.mark.parametrize("case", sorted(CASES))
def test_every_layout_equals_the_eager_experts_in_float64(paths_taken, case, tokens, k):
    """Inference on the CPU: gated layouts the operator fuses in one call, the others (own gate
    rules, no gate, a post-expert norm) in pieces."""
    eager, ours = make_pair(case)
    inputs = make_inputs(tokens, k)
    with torch.no_grad():
        torch.testing.assert_close(ours(*inputs), _eager(eager, *inputs), **EXACT)
    assert paths_taken == [Path.EXPERTS_ONE_CALL if case in ONE_CALL else Path.EXPERTS_PIECES]


@pytest.mark.parametrize("case", ONE_CALL)
def test_int32_ids_and_expert_parallel_sentinels(case):
    eager, ours = make_pair(case)
    hidden, ids, weights = make_inputs(11, 3)
    with torch.no_grad():
        torch.testing.assert_close(ours(hidden, ids.int(), weights), _eager(eager, hidden, ids, weights), **EXACT)
    ours._is_expert_parallel = True
    sentinel = torch.rand(ids.shape, generator=torch.Generator().manual_seed(3)) < 0.4
    with torch.no_grad():
        got = ours(hidden, torch.where(sentinel, E, ids), weights)
    # the same as those choices' weights set to 0 (on any real expert)
    want = _eager(eager, hidden, torch.where(sentinel, 0, ids), torch.where(sentinel, 0.0, weights))
    assert sentinel.any()
    torch.testing.assert_close(got, want, **EXACT)


def test_the_path_is_the_choosers(monkeypatch, paths_taken):
    """With the one-call rule taken out, the same module's call takes the next rule, exact."""
    from tutel.rules import paths
    eager, ours = make_pair("mixtral")
    inputs = make_inputs(5, 2)
    monkeypatch.setattr(paths, "RULES", tuple(rule for rule in paths.RULES
                                              if rule.path is not paths.Path.EXPERTS_ONE_CALL))
    with torch.no_grad():
        torch.testing.assert_close(ours(*inputs), _eager(eager, *inputs), **EXACT)
    assert paths_taken == [Path.EXPERTS_PIECES]


def test_calls_beside_one_call(paths_taken):
    """Autograd, autocast, tokens in another dtype than the weights, tokens of a tensor subclass and
    more rows than one call takes run on their own paths, exact."""
    eager, ours = make_pair("mixtral")
    hidden, ids, weights = make_inputs(7, 2)
    want = _eager(eager, hidden, ids, weights)
    torch.testing.assert_close(ours(hidden, ids, weights), want, **EXACT)  # gradients flow to the parameters
    with torch.no_grad():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            torch.testing.assert_close(ours(hidden, ids, weights).double(), want, rtol=5e-2, atol=5e-2)
        torch.testing.assert_close(ours(hidden.float(), ids, weights.float()).double(), want, rtol=2e-6, atol=2e-6)

        class Marked(torch.Tensor):
            pass
        torch.testing.assert_close(ours(hidden.as_subclass(Marked), ids, weights).as_subclass(torch.Tensor), want,
                                   **EXACT)
        many, many_ids, many_weights = make_inputs(4097, 1)
        torch.testing.assert_close(ours(many, many_ids, many_weights), _eager(eager, many, many_ids, many_weights),
                                   **EXACT)
    assert paths_taken[0] == Path.EXPERTS_GROUPED and paths_taken[-1] == Path.EXPERTS_PIECES


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_16bit_rows_widened_or_not(no_native_16bit, dtype):
    """On a CPU without 16-bit dot products routed experts multiply 16-bit experts with 32+ rows each
    in float32, the few-row calls in their dtype."""
    eager, ours = make_pair("gpt_oss", dtype=dtype)
    eager = eager.double()
    for tokens in (100, 3):  # 40 and 1.2 rows per expert on average
        inputs = make_inputs(tokens, 2, dtype=dtype)
        with torch.no_grad():
            got = ours(*inputs)
        want = _eager(eager, *(t.double() if t.is_floating_point() else t for t in inputs))
        scale = float(want.abs().max())
        torch.testing.assert_close(got.double(), want, rtol=2e-2, atol=2e-2 * scale)


def test_refused_arguments_name_the_module_and_the_argument():
    _, ours = make_pair("mixtral")
    hidden, ids, weights = make_inputs(5, 2)
    with torch.no_grad():
        with pytest.raises(ValueError, match='experts_implementation="tutel": MixtralExperts takes tokens of 12'):
            ours(hidden[:, :11], ids, weights)
        with pytest.raises(ValueError, match="top_k_weights"):
            ours(hidden, ids, weights[:, :1])
        with pytest.raises(TypeError, match="`top_k_weights` of type NoneType"):
            ours(hidden, ids, None)
        with pytest.raises(TypeError, match="`top_k_index` must hold integer expert ids"):
            ours(hidden, ids.double(), weights)
        with pytest.raises(TypeError, match="must be floating point"):
            ours(hidden, ids, ids)


def _both(eager, ours, change):
    change(eager)
    change(ours)


def test_the_kept_layout_follows_the_module(layout_reads):
    """Read once while the module is unchanged; after each change of the module (on the reference
    too) the result is exact: replaced parameters, new values behind a parameter's .data, a new
    dtype, another activation, a subclass with its own gate."""
    eager, ours = make_pair("mixtral")
    inputs = make_inputs(9, 3)
    generator = torch.Generator().manual_seed(11)
    fresh = lambda shape: torch.randn(shape, generator=generator, dtype=torch.float64)

    def check(reads):
        with torch.no_grad():
            for _ in range(2):
                torch.testing.assert_close(ours(*inputs), _eager(eager, *inputs), **EXACT)
        assert len(layout_reads) == reads, layout_reads

    check(1)
    up = fresh(eager.gate_up_proj.shape)
    _both(eager, ours, lambda m: setattr(m, "gate_up_proj", torch.nn.Parameter(up.clone())))
    check(2)
    down = fresh(eager.down_proj.shape)
    _both(eager, ours, lambda m: setattr(m.down_proj, "data", down.clone()))
    check(2)  # the same parameter, read as it is at every call
    with torch.no_grad():
        _both(eager, ours, lambda m: m.gate_up_proj.mul_(-0.5))
    check(2)
    _both(eager, ours, lambda m: setattr(m, "act_fn", torch.nn.GELU()))
    check(3)
    _both(eager, ours, lambda m: setattr(m, "act_fn", torch.nn.SiLU()))
    check(4)

    class Doubled(type(ours)):
        def _apply_gate(self, gate_up):
            return super()._apply_gate(gate_up) * 2
    ours.__class__ = Doubled  # (MixtralExperts' eager forward does not call _apply_gate: the reference is 2x)
    with torch.no_grad():
        torch.testing.assert_close(ours(*inputs), 2 * _eager(eager, *inputs), **EXACT)
    assert len(layout_reads) == 5
    ours.__class__ = Doubled.__mro__[1]
    check(6)
    ours.float()  # .data of every parameter replaced by a float32 copy
    with torch.no_grad():
        got = ours(*[t.float() if t.is_floating_point() else t for t in inputs])
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), _eager(eager, *inputs), rtol=2e-6, atol=2e-6)


def test_replaced_weights_are_not_kept_alive():
    _, ours = make_pair("gpt_oss")
    inputs = make_inputs(3, 2)
    with torch.no_grad():
        ours(*inputs)
    old = weakref.ref(ours.gate_up_proj)
    ours.gate_up_proj = torch.nn.Parameter(ours.gate_up_proj.detach().clone())
    gc.collect()
    assert old() is None


def test_copies_and_pickles_read_their_own_layout():
    eager, ours = make_pair("gpt_oss")
    inputs = make_inputs(6, 2)
    with torch.no_grad():
        ours(*inputs)
        copied, unpickled = copy.deepcopy(ours), pickle.loads(pickle.dumps(ours))
        for module in (copied, unpickled):
            module.down_proj.mul_(3.0)
        eager.down_proj.mul_(3.0)
        want = _eager(eager, *inputs)
        for module in (copied, unpickled):
            torch.testing.assert_close(module(*inputs), want, **EXACT)
        eager.down_proj.div_(3.0)
        torch.testing.assert_close(ours(*inputs), _eager(eager, *inputs), **EXACT)
