"""The calls DeepSpeed's MoE layer makes with use_tutel=True, made directly
(no DeepSpeed needed), against a dense float64 GShard computation.

What DeepSpeed passes (deepspeed/moe/sharded_moe.py, releases 0.14 to 0.19.8):
  * ``tutel.moe.fast_cumsum_sub_one(mask)`` on the int64 [T, E] one-hot mask of
    the kept top-1 choices (its slot numbers).
  * ``fast_dispatcher(E, C, M, dispatch_dtype=x.dtype)`` once per layer, where C
    is the first batch's capacity (a 0-d int64 tensor before 0.19, an int after).
  * ``update(indices_, locations_, gates_, capacity=C)`` every batch, with lists
    of k [T] tensors: int64 (before 0.19, top-1 only) or the rows of int32 [k, T]
    tensors (0.19+, any k).  A dropped choice has index -1, location 0, gate 0.
    Gates are float32 whatever the model dtype (DeepSpeed gates in float32).
  * ``encode(x)`` -> [E*C, M] (0.19+ views it as [E, C, M]); the experts run on
    [E, C, M]; ``decode(expert_output.view(E * C, M))`` -> [T, M].
"""
import math

import pytest
import torch

from tutel import moe


class Routing:
    """One batch's routing as DeepSpeed's gates produce it, in [k, T] layout."""

    def __init__(self, indices, locations, gates, capacity):
        self.indices, self.locations, self.gates, self.capacity = indices, locations, gates, capacity


def top1_routing_before_0_19(gate_probs: torch.Tensor, capacity_factor: float, drop_tokens: bool,
                             random_selection: bool) -> Routing:
    """Top-1 with a capacity from ceil(T / E * factor) (a 0-d int64 tensor), tokens past it dropped.

    With random_selection the kept tokens of a full expert are a random subset, else the first ones.
    """
    tokens, experts = gate_probs.shape
    choice = gate_probs.argmax(dim=1)
    mask = torch.nn.functional.one_hot(choice, experts)
    if drop_tokens:
        capacity = torch.ceil(torch.tensor(tokens / experts * capacity_factor)).to(torch.int64)
    else:
        capacity = mask.sum(dim=0).max()
    priority = torch.rand(tokens, experts) * mask if random_selection else mask.flip(0).cumsum(0).flip(0) * mask
    chosen_rows = torch.topk(priority.float(), k=min(int(capacity), tokens), dim=0).indices
    mask = mask * torch.zeros_like(mask).scatter_(0, chosen_rows, 1)
    kept = mask.sum(dim=1)
    indices = torch.minimum(choice, kept * experts - 1)  # -1 where the token was dropped
    slots = moe.fast_cumsum_sub_one(mask)
    assert slots.dtype == torch.int64 and torch.equal(slots, torch.cumsum(mask, dim=0) - 1)
    locations = (slots * mask).sum(dim=1)
    gates = (gate_probs * mask).sum(dim=1)
    return Routing([indices], [locations], [gates], capacity)


def topk_routing_0_19(gate_probs: torch.Tensor, k: int, capacity_factor: float, drop_tokens: bool) -> Routing:
    """Top-k with slots claimed choice by choice, then token by token; int32 [k, T] rows."""
    tokens, experts = gate_probs.shape
    top_probs, choice = torch.topk(gate_probs, k, dim=1)
    masks = torch.nn.functional.one_hot(choice.t(), experts)  # [k, T, E]
    slots = torch.cumsum(masks.reshape(k * tokens, experts), dim=0).reshape(k, tokens, experts) - 1
    location = (slots * masks).sum(dim=2)  # [k, T]
    if drop_tokens:
        capacity = int(math.ceil(tokens / experts * capacity_factor * k))
    else:
        capacity = int(masks.sum(dim=(0, 1)).max())
    kept = location < capacity
    gates = torch.where(kept, top_probs.t(), torch.zeros_like(top_probs.t()))
    gates = gates / gates.sum(dim=0).clamp(min=torch.finfo(gates.dtype).eps)
    indices = torch.where(kept, choice.t(), torch.full_like(choice.t(), -1)).to(torch.int32)
    locations = torch.where(kept, location, torch.zeros_like(location)).to(torch.int32)
    return Routing(list(indices.unbind(0)), list(locations.unbind(0)), list(gates.unbind(0)), capacity)


class Experts(torch.nn.Module):
    """E two-layer GELU networks applied to an [E, C, M] buffer."""

    def __init__(self, experts: int, model_dim: int, hidden: int, dtype: torch.dtype):
        super().__init__()
        self.w1 = torch.nn.Parameter(torch.randn(experts, model_dim, hidden, dtype=dtype) / model_dim ** 0.5)
        self.b1 = torch.nn.Parameter(torch.randn(experts, 1, hidden, dtype=dtype))
        self.w2 = torch.nn.Parameter(torch.randn(experts, hidden, model_dim, dtype=dtype) / hidden ** 0.5)

    def forward(self, buffer: torch.Tensor) -> torch.Tensor:
        # Parameters follow the buffer's dtype so the float64 reference can share them.
        w1, b1, w2 = (p.to(buffer.dtype) for p in (self.w1, self.b1, self.w2))
        return torch.nn.functional.gelu(buffer @ w1 + b1) @ w2


def dense_moe(x, routing: Routing, experts_module: Experts, num_experts: int):
    """GShard's einsum formulation in float64: combine[t, e, c] = gate where token t fills slot (e, c)."""
    capacity = int(routing.capacity)
    dispatch = torch.zeros(x.shape[0], num_experts, capacity, dtype=torch.float64)
    combine = torch.zeros_like(dispatch)
    for index, location, gate in zip(routing.indices, routing.locations, routing.gates):
        kept = ((index >= 0) & (location < capacity)).double()
        slot = torch.nn.functional.one_hot(index.long().clamp(min=0) * capacity + location.long().clamp(max=capacity),
                                           num_experts * capacity + 1)[:, :-1].reshape(-1, num_experts, capacity)
        dispatch = dispatch + slot.double() * kept[:, None, None]
        combine = combine + slot.double() * (kept * gate.double())[:, None, None]
    expert_input = torch.einsum("tec,tm->ecm", dispatch, x.double())
    return torch.einsum("tec,ecm->tm", combine, experts_module(expert_input))


def run_like_deepspeed(dispatcher, x, routing: Routing, experts_module: Experts, num_experts: int,
                       view_encoded: bool):
    tokens, model_dim = x.shape
    dispatcher.update(routing.indices, routing.locations, routing.gates, capacity=routing.capacity)
    capacity = int(routing.capacity)
    encoded = dispatcher.encode(x)
    assert encoded.shape == (num_experts * capacity, model_dim) and encoded.dtype == x.dtype
    buffer = encoded.view(num_experts, capacity, model_dim) if view_encoded else encoded
    expert_output = experts_module(buffer.reshape(num_experts, capacity, model_dim))
    combined = dispatcher.decode(expert_output.view(num_experts * capacity, model_dim))
    assert combined.shape == (tokens, model_dim) and combined.dtype == x.dtype
    return combined


def gradients(output, upstream, tensors):
    return torch.autograd.grad((output * upstream).sum(), tensors, retain_graph=True)


DESIGNS = ["before-0.19-top1", "0.19-top1", "0.19-top2", "0.19-top3"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("drop_tokens,capacity_factor", [(True, 0.5), (True, 1.25), (False, 1.0)])
@pytest.mark.parametrize("design", DESIGNS)
def test_deepspeed_calls_match_dense_gshard(design, drop_tokens, capacity_factor, dtype):
    torch.manual_seed(100 * DESIGNS.index(design) + int(8 * capacity_factor))
    experts, model_dim, hidden = 6, 5, 9
    gate_weight = torch.randn(experts, model_dim, requires_grad=True)
    experts_module = Experts(experts, model_dim, hidden, dtype)
    dispatcher = None
    for tokens in (41, 7, 64):  # one dispatcher, several batches (DeepSpeed builds it once)
        x = torch.randn(tokens, model_dim, dtype=dtype, requires_grad=True)
        gate_probs = torch.softmax(x.float() @ gate_weight.t(), dim=1)  # DeepSpeed gates in float32
        if design == "before-0.19-top1":
            routing = top1_routing_before_0_19(gate_probs, capacity_factor, drop_tokens, random_selection=True)
        else:
            routing = topk_routing_0_19(gate_probs, int(design[-1]), capacity_factor, drop_tokens)
        if dispatcher is None:
            dispatcher = moe.fast_dispatcher(experts, routing.capacity, model_dim, dispatch_dtype=x.dtype)
        dropped = sum(int((index < 0).sum()) for index in routing.indices)
        if not drop_tokens:
            assert dropped == 0
        elif capacity_factor < 1:
            assert dropped > 0, "the case meant to drop tokens dropped none"

        output = run_like_deepspeed(dispatcher, x, routing, experts_module, experts,
                                    view_encoded=not design.startswith("before"))
        expected = dense_moe(x, routing, experts_module, experts)
        tolerance = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(output.double(), expected, **tolerance)

        upstream = torch.randn(tokens, model_dim, dtype=dtype)
        leaves = [x, gate_weight, *experts_module.parameters()]
        for actual, reference in zip(gradients(output, upstream, leaves),
                                     gradients(expected, upstream.double(), leaves)):
            torch.testing.assert_close(actual.double(), reference.double(), **tolerance)


def test_top1_without_random_selection_keeps_the_first_tokens():
    probs = torch.tensor([[0.9, 0.1]] * 5 + [[0.2, 0.8]])
    routing = top1_routing_before_0_19(probs, capacity_factor=1.0, drop_tokens=True, random_selection=False)
    assert int(routing.capacity) == 3
    assert routing.indices[0].tolist() == [0, 0, 0, -1, -1, 1]
    assert routing.locations[0].tolist() == [0, 1, 2, 0, 0, 0]
    dispatcher = moe.fast_dispatcher(2, routing.capacity, 1, dispatch_dtype=torch.float64)
    dispatcher.update(routing.indices, routing.locations, routing.gates, capacity=routing.capacity)
    x = torch.arange(1.0, 7.0, dtype=torch.float64)[:, None]
    # Dropped tokens 4 and 5 (index -1, location 0) must not be added into slot (0, 0).
    assert dispatcher.encode(x).flatten().tolist() == [1.0, 2.0, 3.0, 6.0, 0.0, 0.0]
    combined = dispatcher.decode(torch.full((6, 1), 10.0, dtype=torch.float64))
    torch.testing.assert_close(combined.flatten(), 10.0 * routing.gates[0].double())
    assert combined[3:5].abs().sum() == 0
