"""tutel.ops.route_experts against the float64 reference of reference_route_experts.py (forward and
the logits' gradient) for every option combination, k = 1..8, 1 to 300 experts, DeepSeek-V3's groups,
empty, tiny, odd and large batches, dropping capacities, ties and NaN; against today's composition of
route_topk / assign_locations / normalize_gates / gshard_loss_from_counts; on fake CUDA tensors; as
one operator per call; and its argument errors."""
import itertools

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import reference_route_experts as ref
from conftest import ALL_DTYPES
from tutel.ops.route_experts import ExpertRouting, route_experts

SCORES = [("softmax", False), ("softmax", True), ("sigmoid", False), ("sqrt_softplus", False)]


def accumulation(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def value_tolerance(dtype):
    """Two roundings of the logits' dtype, for choice scores computed two ways."""
    return dict(rtol=4 * torch.finfo(dtype).eps, atol=4 * torch.finfo(dtype).tiny)


def result_tolerance(dtype, tokens=1):
    """Weights and loss are computed in the accumulation dtype from the (exact) logits; sums over many
    tokens may round more."""
    if dtype == torch.float64:
        return dict(rtol=1e-12, atol=1e-12)
    return dict(rtol=1e-5 * max(1.0, tokens / 500), atol=1e-6)


def random_logits(tokens, experts, dtype, generator, scale=2.0):
    return (torch.randn(tokens, experts, generator=generator, dtype=torch.float64) * scale).to(dtype)


def run(logits, o: ref.Options, bias=None, device="cpu"):
    """The operator's result and the logits' gradient for random gradients of weights and loss, computed
    on `device` and returned on the CPU."""
    on_device = logits.to(device).requires_grad_(True)
    routing = route_experts(on_device, o.k, selection_bias=None if bias is None else bias.to(device), **o.kwargs())
    generator = torch.Generator().manual_seed(7)
    grad_weights = torch.randn(routing.weights.shape, generator=generator, dtype=routing.weights.dtype)
    grad_loss = torch.tensor(0.75, dtype=routing.l_aux.dtype)
    grad, = torch.autograd.grad((routing.weights, routing.l_aux), on_device,
                                (grad_weights.to(device), grad_loss.to(device)), allow_unused=True)
    return ExpertRouting(*(value.cpu() for value in routing)), grad.cpu(), grad_weights, grad_loss


def op_priority(routing, logits, o: ref.Options, bias):
    """The top-1 choice score the operator claimed slots by, where it follows exactly from its outputs
    (else None): with softmax_after_topk it is round(z + round(b)); without renormalisation and scaling
    the top-1 weight is the score s itself."""
    dtype = logits.dtype
    first = routing.expert_ids[0].long()
    if o.softmax_after_topk:
        base = logits.double().gather(1, first[:, None])[:, 0]
    elif not o.renormalize and o.routed_scaling_factor == 1.0:
        base = ref.rounded(routing.weights[0].double(), dtype)
    else:
        return None
    if bias is not None:
        base = ref.rounded(base + bias.to(dtype).double()[first], dtype)
    return base


def check_slots(routing, c, o: ref.Options, priority, num_experts, dtype):
    """GShard slots of the operator's choices: exactly the reference's given the claiming order; when
    that order is not known exactly (`priority` None), every (choice, expert) holds consecutive slots
    claimed by non-increasing top-1 choice scores (within two roundings; NaN first)."""
    ids = routing.expert_ids.t().long()
    tokens = ids.shape[0]
    if not (o.batch_prioritized and priority is None):
        order = ref.claiming_order(priority if o.batch_prioritized else None, tokens)
        locations, counts = ref.gshard_slots(ids, num_experts, order)
        assert torch.equal(routing.locations.t().long(), locations), "locations"
        assert torch.equal(routing.counts.long(), counts), "counts"
        return locations
    locations = routing.locations.t().long()
    _, counts = ref.gshard_slots(ids, num_experts, torch.arange(tokens))
    assert torch.equal(routing.counts.long(), counts), "counts"
    before = torch.cumsum(counts, dim=0) - counts
    top = c.gather(1, ids[:, :1])[:, 0].nan_to_num(nan=float("inf"))
    tolerance = value_tolerance(dtype)
    for j in range(o.k):
        for e in range(num_experts):
            members = torch.nonzero(ids[:, j] == e).flatten()
            slots, order = torch.sort(locations[members, j])
            assert torch.equal(slots, before[j, e] + torch.arange(len(members))), ("slots", j, e)
            claimed = top[members[order]]
            slack = tolerance["rtol"] * claimed[:-1].abs().nan_to_num(posinf=0.0) + tolerance["atol"]
            assert bool((claimed[1:] <= claimed[:-1] + slack).all()), ("claiming order", j, e)
    return locations


def check_routing(logits, o: ref.Options, bias=None, check_grad=True, device="cpu"):
    dtype = logits.dtype
    tokens, num_experts = logits.shape
    routing, grad, grad_weights, grad_loss = run(logits, o, bias, device)
    acc = accumulation(dtype)
    assert routing.weights.dtype == acc and routing.l_aux.dtype == acc and routing.l_aux.dim() == 0
    # The choice: the reference's top-k choice scores (ties within two roundings may pick either expert).
    c = ref.choice_scores(logits, o, bias)
    ids = routing.expert_ids.t().long()
    assert routing.expert_ids.dtype == torch.int32 and tuple(routing.expert_ids.shape) == (o.k, tokens)
    if tokens:
        assert bool(((ids >= 0) & (ids < num_experts)).all())
        assert bool((torch.sort(ids, dim=1).values.diff(dim=1) > 0).all()), "an expert chosen twice"
        torch.testing.assert_close(c.gather(1, ids), c.gather(1, ref.top_k(c, o.k)), equal_nan=True,
                                   **value_tolerance(dtype), msg=lambda m: f"choice scores: {m}")
    # Slots, counts and the grouped plan.
    locations = check_slots(routing, c, o, op_priority(routing, logits, o, bias), num_experts, dtype)
    assert torch.equal(routing.dispatch_count, torch.bincount(ids.flatten(), minlength=num_experts))
    grouped, ends, row_choices = ref.grouped_plan(ids, locations, routing.counts.long(), o.capacity)
    assert torch.equal(routing.grouped_locations.t().long(), grouped), "grouped_locations"
    assert torch.equal(routing.ends.long(), ends), "ends"
    assert torch.equal(routing.row_choices.long(), row_choices), "row_choices"
    # Weights and loss as float64 functions of the logits, and their gradient.
    z = logits.double().requires_grad_(True)
    weights = ref.weights(z, ids, o, dtype)
    loss = ref.gshard_loss(z, ids[:, 0], o, dtype)
    torch.testing.assert_close(routing.weights.t().double(), weights.detach(), equal_nan=True,
                               **result_tolerance(dtype), msg=lambda m: f"weights: {m}")
    torch.testing.assert_close(routing.l_aux.double(), loss.detach(), equal_nan=True,
                               **result_tolerance(dtype, tokens), msg=lambda m: f"l_aux: {m}")
    if not check_grad:
        return routing
    outputs = [(weights, grad_weights.t().double()), (loss, grad_loss.double())]
    outputs = [(value, grad_value) for value, grad_value in outputs if value.requires_grad]
    want, = torch.autograd.grad([value for value, _ in outputs], z, [grad_value for _, grad_value in outputs],
                                allow_unused=True)
    want = torch.zeros_like(z) if want is None else want
    assert grad.dtype == dtype
    # Stored in the logits' dtype.  Its terms cancel (softmax, renormalisation): the absolute part
    # follows the largest result and the terms' size, d weights / min(sum of u) and d loss * E / T.
    tolerance = dict(result_tolerance(dtype, tokens)) if dtype in (torch.float32, torch.float64) else \
        dict(rtol=2 * torch.finfo(dtype).eps, atol=0.0)
    largest = float(want.abs().max()) if want.numel() else 0.0
    smallest_sum = float(ref.weights(z.detach(), ids, o._replace(renormalize=False, routed_scaling_factor=1.0),
                                     dtype).sum(dim=1).min()) if tokens and o.renormalize else 1.0
    terms = float(grad_weights.abs().max()) * o.routed_scaling_factor / min(1.0, max(smallest_sum, 1e-30)) \
        if tokens else 0.0
    terms += float(grad_loss) * num_experts / max(tokens, 1)
    tolerance["atol"] += tolerance["rtol"] * largest + 64 * torch.finfo(acc).eps * terms
    torch.testing.assert_close(grad.double(), want, equal_nan=True, **tolerance, msg=lambda m: f"d logits: {m}")
    return routing


def option_combinations(k, n_group, topk_group, bias):
    """(options, selection bias) for every combination of the options."""
    for (score, after), with_bias, groups, renormalize, scale, prioritized, capacity, with_loss in itertools.product(
            SCORES, (False, True), (False, True), (False, True), (1.0, 2.5), (False, True), (-1, 0, 3), (True, False)):
        yield ref.Options(k, score, after, n_group if groups else None, topk_group if groups else None, renormalize,
                          scale, prioritized, capacity, with_loss), bias if with_bias else None


# float32 takes every combination; the other dtypes a spread of them (each option value many times).
COMBINATION_STEP = {torch.float32: 1, torch.bfloat16: 5, torch.float64: 7, torch.float16: 7}


@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_every_option_combination_matches_the_float64_reference(dtype):
    generator = torch.Generator().manual_seed(11)
    logits = random_logits(37, 16, dtype, generator)
    bias = torch.randn(16, generator=generator) * 0.3
    for o, selection_bias in list(option_combinations(3, 4, 2, bias))[::COMBINATION_STEP[dtype]]:
        check_routing(logits, o, selection_bias)


@pytest.mark.parametrize("k", range(1, 9))
def test_k_from_one_to_eight(k):
    generator = torch.Generator().manual_seed(k)
    for tokens, experts in ((0, 8), (1, 8), (29, 9), (64, 64)):
        if k > experts:
            continue
        logits = random_logits(tokens, experts, torch.float32, generator)
        for capacity in (-1, 2):
            check_routing(logits, ref.Options(k, renormalize=True, capacity=capacity, batch_prioritized=k % 2 == 0))
            check_routing(logits, ref.Options(k, "sigmoid", capacity=capacity, routed_scaling_factor=1.5),
                          torch.randn(experts, generator=generator))


@pytest.mark.parametrize("experts", [1, 2, 5, 31, 32, 33, 100, 300])
@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_one_to_three_hundred_experts(experts, dtype):
    generator = torch.Generator().manual_seed(experts)
    logits = random_logits(45, experts, dtype, generator)
    k = min(experts, 4)
    check_routing(logits, ref.Options(k, renormalize=k > 1, capacity=5))
    check_routing(logits, ref.Options(k, "sqrt_softplus", renormalize=True, batch_prioritized=True),
                  torch.randn(experts, generator=generator, dtype=torch.float64))
    check_routing(logits, ref.Options(k, softmax_after_topk=True, capacity=0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_deepseek_v3_groups_at_several_thousand_tokens(dtype):
    """256 experts in 8 groups, the best 4 groups, k = 8, sigmoid scores with a selection bias,
    renormalised and scaled by 2.5; dropless and with a capacity that drops."""
    generator = torch.Generator().manual_seed(3)
    logits = random_logits(2048, 256, dtype, generator)
    bias = torch.randn(256, generator=generator) * 0.05
    for capacity in (-1, 48):
        o = ref.Options(8, "sigmoid", n_group=8, topk_group=4, renormalize=True, routed_scaling_factor=2.5,
                        capacity=capacity)
        routing = check_routing(logits, o, bias, check_grad=dtype == torch.float32)
        if capacity > 0:
            assert int((routing.grouped_locations == 256 * capacity).sum()) > 0, "the capacity drops choices"


def test_several_thousand_tokens_with_priorities_and_drops():
    generator = torch.Generator().manual_seed(5)
    logits = random_logits(3001, 24, torch.float32, generator)
    for o in (ref.Options(2, capacity=200, batch_prioritized=True),
              ref.Options(2, softmax_after_topk=True, renormalize=True, capacity=180, batch_prioritized=True),
              ref.Options(4, "sigmoid", renormalize=True, capacity=-1)):
        routing = check_routing(logits, o)
        if o.capacity > 0:
            assert int((routing.locations >= o.capacity).sum()) > 0


@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_ties_and_nan_follow_route_topks_rules(dtype):
    """Equal logits give equal choice scores: the lower expert wins; a NaN score ranks first (a NaN
    logit makes a softmax row all NaN, so its experts 0..k-1 are chosen); -0 equals +0; equal top-1
    scores claim slots in token order."""
    logits = torch.tensor([[0.5, 1.0, 1.0, 0.5, 1.0],
                           [0.0, -0.0, 0.0, -1.0, -0.0],
                           [1.0, float("nan"), 2.0, 0.0, 3.0],
                           [float("-inf"), 1.0, float("-inf"), 1.0, float("inf")],
                           [0.5, 1.0, 1.0, 0.5, 1.0]], dtype=dtype)
    for score, after in SCORES:
        for prioritized in (False, True):
            o = ref.Options(3, score, after, batch_prioritized=prioritized, capacity=2, with_loss=False)
            routing, _, _, _ = run(logits, o)
            c = ref.choice_scores(logits, o, None)
            assert torch.equal(routing.expert_ids.t().long(), ref.top_k(c, 3)), (score, after)
            check_routing(logits, o, check_grad=False)
    routing = route_experts(logits, 3)
    assert routing.expert_ids[:, 0].tolist() == [1, 2, 4] and routing.expert_ids[:, 2].tolist() == [0, 1, 2]


def test_equals_the_current_composition():
    """route_topk on the composition's choice scores, assign_locations with the top-1 choice as priority,
    normalize_gates and gshard_loss_from_counts: the same experts, slots and counts, the weights and the
    loss to rounding."""
    from tutel.impls.fast_dispatch import normalize_gates
    from tutel.impls.losses import gshard_loss_from_counts
    from tutel.ops import assign_locations, route_topk

    generator = torch.Generator().manual_seed(2)
    for dtype in ALL_DTYPES:
        logits = random_logits(300, 12, dtype, generator)
        for prioritized, capacity in ((False, -1), (True, 20)):
            routing = route_experts(logits, 2, renormalize=True, batch_prioritized=prioritized, capacity=capacity)
            scores = torch.softmax(logits, dim=1)
            composed = route_topk(scores, 2, batch_prioritized=prioritized)
            # The operator's softmax may round differently in the last place: its choices are
            # route_topk's up to such ties.
            torch.testing.assert_close(scores.gather(1, routing.expert_ids.t().long()),
                                       scores.gather(1, composed.indices.t().long()), **value_tolerance(dtype))
            # Its slots are assign_locations' for its choices, with its own top-1 score (the weight of
            # a call without renormalisation, which chooses alike) as the priority.
            priority = None
            if prioritized:
                priority = route_experts(logits, 2, batch_prioritized=True, capacity=capacity).weights[0].to(dtype)
            locations, counts = assign_locations(routing.expert_ids, 12, priority)
            assert torch.equal(routing.locations, locations) and torch.equal(routing.counts, counts)
            assert torch.equal(routing.dispatch_count, counts.sum(dim=0).long())
            gates = normalize_gates(scores.t().gather(0, routing.expert_ids.long()))
            torch.testing.assert_close(routing.weights.to(dtype), gates, atol=2 * torch.finfo(dtype).eps, rtol=0)
            loss = gshard_loss_from_counts(scores.double(), counts[0])
            torch.testing.assert_close(routing.l_aux.double(), loss, rtol=2 * torch.finfo(dtype).eps, atol=0.0)


def test_fake_cuda_tensors_trace_without_data_dependent_shapes():
    """On fake CUDA tensors (no shape environment) the forward and the backward operator run through
    their fake kernels: every size follows from the shapes and int arguments.  (Autograd itself needs
    a CUDA build for CUDA tensors, so the wrapper's autograd is traced on fake CPU tensors.)"""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        logits = torch.empty(5, 256, device="cuda", dtype=torch.bfloat16)
        bias = torch.empty(256, device="cuda")
        for capacity, rows in ((-1, 40), (3, 768)):
            routing = route_experts(logits, 8, score_function="sigmoid", selection_bias=bias, n_group=8, topk_group=4,
                                    renormalize=True, routed_scaling_factor=2.5, capacity=capacity,
                                    batch_prioritized=True)
            assert routing.expert_ids.device.type == "cuda"
            assert tuple(routing.row_choices.shape) == (rows,) and routing.weights.dtype == torch.float32
            assert tuple(routing.dispatch_count.shape) == (256,) and routing.dispatch_count.dtype == torch.int64
            grad = torch.ops.tutel.route_experts_backward(torch.ones_like(routing.weights), routing.l_aux, logits,
                                                          routing.expert_ids, routing.counts, "sigmoid", False, True,
                                                          2.5, True)
            assert grad.shape == logits.shape and grad.dtype == torch.bfloat16 and grad.device.type == "cuda"
        cpu_logits = torch.empty(7, 16, dtype=torch.float16, requires_grad=True)
        routing = route_experts(cpu_logits, 2, softmax_after_topk=True, capacity=4)
        grad, = torch.autograd.grad((routing.weights.sum() + routing.l_aux,), cpu_logits)
        assert grad.shape == cpu_logits.shape and grad.dtype == torch.float16


class _OperatorLog(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func.overloadpacket).replace("aten.", "").replace("tutel.", "tutel::"))
        return func(*args, **(kwargs or {}))


def test_one_operator_forward_and_one_backward():
    logits = torch.randn(9, 16, requires_grad=True)
    bias = torch.zeros(16, requires_grad=True)  # a trainable-looking bias gets no gradient
    with _OperatorLog() as forward:
        routing = route_experts(logits, 2, score_function="sigmoid", selection_bias=bias, renormalize=True,
                                capacity=-1, batch_prioritized=True)
    grads = (torch.ones_like(routing.weights), torch.ones_like(routing.l_aux))
    with _OperatorLog() as backward:
        torch.autograd.grad((routing.weights, routing.l_aux), logits, grads)
    assert [name for name in forward.names if name != "detach"] == ["tutel::route_experts"]
    assert backward.names == ["tutel::route_experts_backward"]
    with torch.no_grad(), _OperatorLog() as no_grad:
        route_experts(logits, 2)
    assert no_grad.names == ["tutel::route_experts"]


@pytest.mark.parametrize("call, error, message", [
    (lambda z: route_experts(z, 0), ValueError, "top_k"),
    (lambda z: route_experts(z, 9), ValueError, "top_k"),
    (lambda z: route_experts(z.long(), 2), TypeError, "logits"),
    (lambda z: route_experts(z[0], 2), ValueError, "logits"),
    (lambda z: route_experts(z, 2, score_function="relu"), ValueError, "score_function"),
    (lambda z: route_experts(z, 2, score_function="sigmoid", softmax_after_topk=True), ValueError, "softmax"),
    (lambda z: route_experts(z, 2, selection_bias=torch.zeros(7)), ValueError, "selection_bias"),
    (lambda z: route_experts(z, 2, selection_bias=torch.zeros(8, dtype=torch.int32)), TypeError, "selection_bias"),
    (lambda z: route_experts(z, 2, n_group=3, topk_group=1), ValueError, "n_group"),
    (lambda z: route_experts(z, 2, n_group=4), ValueError, "topk_group"),
    (lambda z: route_experts(z, 2, n_group=4, topk_group=5), ValueError, "topk_group"),
    (lambda z: route_experts(z, 5, n_group=4, topk_group=2), ValueError, "k=5"),
    (lambda z: route_experts(z, 2, routed_scaling_factor=float("nan")), ValueError, "routed_scaling_factor"),
    (lambda z: route_experts(z, 2, capacity=-2), ValueError, "capacity"),
    (lambda z: route_experts(z, 2, renormalize=1), TypeError, "renormalize"),
    (lambda z: torch.ops.tutel.route_experts(z, 2, "tanh", False, None, 0, 0, False, 1.0, False, -1, True),
     ValueError, "score_function"),
    (lambda z: torch.ops.tutel.route_experts(z, 2, "softmax", False, None, 4, 5, False, 1.0, False, -1, True),
     ValueError, "topk_group"),
    (lambda z: torch.ops.tutel.route_experts(z, 2, "softmax", False, None, 0, 0, False, 1.0, False, -3, True),
     ValueError, "capacity"),
    (lambda z: torch.ops.tutel.route_experts_backward(None, None, z, torch.full((2, 4), 8, dtype=torch.int32),
                                                      torch.zeros(2, 8, dtype=torch.int32), "softmax", False, False,
                                                      1.0, True), IndexError, "expert_ids"),
])
def test_bad_arguments_raise_naming_them(call, error, message):
    with pytest.raises(error, match=message):
        call(torch.randn(4, 8))


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@needs_cuda
@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_cuda_matches_the_float64_reference(dtype):
    """The CUDA kernels against the same reference (their exp may round differently from the CPU's, so
    the choice is held to the reference's scores, as on the CPU)."""
    generator = torch.Generator().manual_seed(13)
    for tokens, experts, k in ((0, 8, 2), (1, 256, 8), (37, 16, 3), (3001, 64, 4), (9000, 8, 2)):
        logits = random_logits(tokens, experts, dtype, generator)
        bias = torch.randn(experts, generator=generator) * 0.1
        groups = (8, 4) if experts % 8 == 0 and k <= 4 * experts // 8 else (None, None)
        for o, selection_bias in ((ref.Options(k, renormalize=True, capacity=-1), None),
                                  (ref.Options(k, batch_prioritized=True, capacity=max(1, tokens * k // experts // 2)),
                                   None),
                                  (ref.Options(k, "sigmoid", n_group=groups[0], topk_group=groups[1], renormalize=True,
                                               routed_scaling_factor=2.5, capacity=3), bias),
                                  (ref.Options(k, "sqrt_softplus", renormalize=True, batch_prioritized=True), bias),
                                  (ref.Options(k, softmax_after_topk=True, capacity=2, with_loss=False), None)):
            check_routing(logits, o, selection_bias, device="cuda")


@needs_cuda
def test_cuda_is_deterministic_and_replays_from_a_graph():
    """Two calls give the same bits (no float atomics), and a captured call replays them."""
    logits = torch.randn(2048, 256, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(256, device="cuda") * 0.1
    kwargs = dict(score_function="sigmoid", selection_bias=bias, n_group=8, topk_group=4, renormalize=True,
                  routed_scaling_factor=2.5, capacity=64, batch_prioritized=True)
    first, second = route_experts(logits, 8, **kwargs), route_experts(logits, 8, **kwargs)
    for a, b in zip(first, second):
        assert torch.equal(a, b)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        route_experts(logits, 8, **kwargs)  # compiled and loaded before the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = route_experts(logits, 8, **kwargs)
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(captured, first):
        assert torch.equal(a, b)
