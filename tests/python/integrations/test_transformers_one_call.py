"""The "tutel" experts forward's shortcut for CPU inference (one_call.py): the layouts it serves
against the class's own eager forward in float64, the layouts and calls it leaves to the full path,
and its cached layout following every change of the module."""
import copy
import gc
import pickle
import weakref

import pytest
import torch

from transformers_test_setup import one_intra_op_thread  # noqa: F401  (autouse fixture)

pytest.importorskip("transformers")
import tutel.integrations.transformers as tutel_hf  # noqa: E402
from tutel.integrations.transformers.one_call import one_call_forward  # noqa: E402

from tiny_transformers_experts import CASES, E, make_inputs, make_pair  # noqa: E402

EXACT = dict(rtol=1e-10, atol=1e-10)
SERVED = ("mixtral", "gpt_oss", "aria")  # SwiGLU, gpt-oss' clamped interleaved unit, transposed SwiGLU


def _eager(module, *inputs):
    with torch.no_grad():
        return module(*inputs)


@pytest.mark.parametrize("tokens,k", [(13, 3), (1, 2), (1, 1), (0, 2), (6, 5)])
@pytest.mark.parametrize("case", SERVED)
def test_served_layouts_equal_the_eager_experts_in_float64(case, tokens, k):
    eager, ours = make_pair(case)
    inputs = make_inputs(tokens, k)
    with torch.no_grad():
        got = one_call_forward(ours, *inputs)
        through_the_module = ours(*inputs)
    assert got is not None, "the shortcut declined"
    want = _eager(eager, *inputs)
    torch.testing.assert_close(got, want, **EXACT)
    torch.testing.assert_close(through_the_module, want, **EXACT)


@pytest.mark.parametrize("case", SERVED)
def test_int32_ids_and_expert_parallel_sentinels(case):
    eager, ours = make_pair(case)
    hidden, ids, weights = make_inputs(11, 3)
    with torch.no_grad():
        torch.testing.assert_close(one_call_forward(ours, hidden, ids.int(), weights), _eager(eager, hidden, ids,
                                                                                               weights), **EXACT)
    ours._is_expert_parallel = True
    sentinel = torch.rand(ids.shape, generator=torch.Generator().manual_seed(3)) < 0.4
    with torch.no_grad():
        got = one_call_forward(ours, hidden, torch.where(sentinel, E, ids), weights)
    # the same as those choices' weights set to 0 (on any real expert)
    want = _eager(eager, hidden, torch.where(sentinel, 0, ids), torch.where(sentinel, 0.0, weights))
    assert got is not None and sentinel.any()
    torch.testing.assert_close(got, want, **EXACT)


@pytest.mark.parametrize("case", sorted(set(CASES) - set(SERVED)))
def test_other_layouts_take_the_full_path(case):
    """Own gate rules, no gate, a post-expert norm: declined, and the module's result is exact."""
    eager, ours = make_pair(case)
    inputs = make_inputs(9, 2)
    with torch.no_grad():
        assert one_call_forward(ours, *inputs) is None
        torch.testing.assert_close(ours(*inputs), _eager(eager, *inputs), **EXACT)


def test_the_shortcut_runs_only_where_the_chooser_picks_one_call(monkeypatch):
    """The path is tutel.rules.paths.choose_path's to pick: with the one-call rule taken out, the
    shortcut declines, and the module's result (the full path's other rule) stays exact."""
    from tutel.rules import paths
    eager, ours = make_pair("mixtral")
    inputs = make_inputs(5, 2)
    with torch.no_grad():
        assert one_call_forward(ours, *inputs) is not None
    monkeypatch.setattr(paths, "RULES", tuple(rule for rule in paths.RULES
                                              if rule.path is not paths.Path.EXPERTS_ONE_CALL))
    with torch.no_grad():
        assert one_call_forward(ours, *inputs) is None
        torch.testing.assert_close(ours(*inputs), _eager(eager, *inputs), **EXACT)


def test_calls_the_shortcut_declines():
    """Autograd, autocast, tokens in another dtype than the weights, more rows than one call takes,
    tokens of a tensor subclass: each left to the full path, whose result stays exact."""
    eager, ours = make_pair("mixtral")
    hidden, ids, weights = make_inputs(7, 2)
    want = _eager(eager, hidden, ids, weights)
    assert one_call_forward(ours, hidden, ids, weights) is None  # gradients flow to the parameters
    with torch.no_grad():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert one_call_forward(ours, hidden, ids, weights) is None
        assert one_call_forward(ours, hidden.float(), ids, weights.float()) is None
        torch.testing.assert_close(ours(hidden.float(), ids, weights.float()).double(), want, rtol=2e-6, atol=2e-6)

        class Marked(torch.Tensor):
            pass
        assert one_call_forward(ours, hidden.as_subclass(Marked), ids, weights) is None
        many, many_ids, many_weights = make_inputs(4097, 1)
        assert one_call_forward(ours, many, many_ids, many_weights) is None
        torch.testing.assert_close(ours(many, many_ids, many_weights), _eager(eager, many, many_ids, many_weights),
                                   **EXACT)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_16bit_rows_the_full_path_widens_are_declined(no_native_16bit, dtype):
    """On a CPU without 16-bit dot products routed_experts multiplies 16-bit experts with 32+ rows
    each in float32: the shortcut leaves those calls to it and serves the few-row ones."""
    eager, ours = make_pair("gpt_oss", dtype=dtype)
    eager = eager.double()
    for tokens, served in ((100, False), (3, True)):  # 40 and 1.2 rows per expert on average
        inputs = make_inputs(tokens, 2, dtype=dtype)
        with torch.no_grad():
            assert (one_call_forward(ours, *inputs) is not None) == served
            got = ours(*inputs)
        want = _eager(eager, *(t.double() if t.is_floating_point() else t for t in inputs))
        scale = float(want.abs().max())
        torch.testing.assert_close(got.double(), want, rtol=2e-2, atol=2e-2 * scale)


def test_refused_arguments_raise_the_full_paths_errors():
    """The operator refuses them, and the full path names what is wrong (as with autograd)."""
    _, ours = make_pair("mixtral")
    hidden, ids, weights = make_inputs(5, 2)
    with torch.no_grad():
        with pytest.raises(ValueError, match='experts_implementation="tutel": MixtralExperts takes tokens of 12'):
            ours(hidden[:, :11], ids, weights)
        with pytest.raises(ValueError, match="top_k_weights"):
            ours(hidden, ids, weights[:, :1])
        with pytest.raises(TypeError, match="`top_k_weights` of type NoneType"):
            ours(hidden, ids, None)
        with pytest.raises(TypeError, match="expert_ids"):
            ours(hidden, ids.double(), weights)


def _both(eager, ours, change):
    change(eager)
    change(ours)


def test_the_cached_layout_follows_the_module():
    """After each change of the module (on the reference too), the shortcut's result is exact:
    replaced parameters, new values behind a parameter's .data, a new dtype, an activation it cannot
    fuse, a subclass with its own gate."""
    eager, ours = make_pair("mixtral")
    inputs = make_inputs(9, 3)
    generator = torch.Generator().manual_seed(11)
    fresh = lambda shape: torch.randn(shape, generator=generator, dtype=torch.float64)

    def check(served=True):
        with torch.no_grad():
            got = one_call_forward(ours, *inputs)
            assert (got is not None) == served
            torch.testing.assert_close(ours(*inputs), _eager(eager, *inputs), **EXACT)
            if served:
                torch.testing.assert_close(got, _eager(eager, *inputs), **EXACT)

    check()
    up = fresh(eager.gate_up_proj.shape)
    _both(eager, ours, lambda m: setattr(m, "gate_up_proj", torch.nn.Parameter(up.clone())))
    check()
    down = fresh(eager.down_proj.shape)
    _both(eager, ours, lambda m: setattr(m.down_proj, "data", down.clone()))
    check()
    with torch.no_grad():
        _both(eager, ours, lambda m: m.gate_up_proj.mul_(-0.5))
    check()
    _both(eager, ours, lambda m: setattr(m, "act_fn", torch.nn.GELU()))
    check(served=False)
    _both(eager, ours, lambda m: setattr(m, "act_fn", torch.nn.SiLU()))
    check()

    class Doubled(type(ours)):
        def _apply_gate(self, gate_up):
            return super()._apply_gate(gate_up) * 2
    ours.__class__ = Doubled  # (MixtralExperts' eager forward does not call _apply_gate: the reference is 2x)
    with torch.no_grad():
        assert one_call_forward(ours, *inputs) is None
        torch.testing.assert_close(ours(*inputs), 2 * _eager(eager, *inputs), **EXACT)
    ours.__class__ = Doubled.__mro__[1]
    check()
    ours.float()  # .data of every parameter replaced by a float32 copy
    with torch.no_grad():
        inputs32 = [t.float() if t.is_floating_point() else t for t in inputs]
        got = one_call_forward(ours, *inputs32)
    assert got is not None and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), _eager(eager, *inputs), rtol=2e-6, atol=2e-6)


def test_replaced_weights_are_not_kept_alive():
    _, ours = make_pair("gpt_oss")
    inputs = make_inputs(3, 2)
    with torch.no_grad():
        assert one_call_forward(ours, *inputs) is not None
    old = weakref.ref(ours.gate_up_proj)
    ours.gate_up_proj = torch.nn.Parameter(ours.gate_up_proj.detach().clone())
    gc.collect()
    assert old() is None


def test_copies_and_pickles_read_their_own_layout():
    eager, ours = make_pair("gpt_oss")
    inputs = make_inputs(6, 2)
    with torch.no_grad():
        assert one_call_forward(ours, *inputs) is not None
        copied, unpickled = copy.deepcopy(ours), pickle.loads(pickle.dumps(ours))
        for module in (copied, unpickled):
            module.down_proj.mul_(3.0)
        eager.down_proj.mul_(3.0)
        want = _eager(eager, *inputs)
        for module in (copied, unpickled):
            torch.testing.assert_close(one_call_forward(module, *inputs), want, **EXACT)
        eager.down_proj.div_(3.0)
        torch.testing.assert_close(one_call_forward(ours, *inputs), _eager(eager, *inputs), **EXACT)


def test_the_registered_forward_takes_the_shortcut(monkeypatch):
    """Inference through transformers' dispatch reaches one_call_forward and nothing else."""
    eager, ours = make_pair("mixtral")
    inputs = make_inputs(4, 2)

    def refuse(*args, **kwargs):
        raise AssertionError("the full path ran")
    monkeypatch.setattr(tutel_hf.forward, "routed_experts", refuse)
    with torch.no_grad():
        torch.testing.assert_close(ours(*inputs), _eager(eager, *inputs), **EXACT)
