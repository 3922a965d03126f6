"""plan_routing: the grouping of routed experts' (token, expert) choices by expert.

Reference: the definition written as a Python loop over the choices in token-major order
(t * k + j), which hands every kept choice the next free slot of its expert, experts one after
the other, and puts the dropped ones (ids outside [0, E)) after all kept ones.  Both
implementations are held to it: tutel's ``group_by_expert`` operator (CPU) and the composite
tensor-ops version that devices without tutel's kernels run (tutel.ops.composite.group_by_expert).
"""
import pytest
import torch

from tutel.paths.plans import plan_routing
from tutel.ops.backend import use_operators


def reference_plan(expert_ids: torch.Tensor, num_experts: int):
    tokens, k = expert_ids.shape
    ids = expert_ids.tolist()
    counts = [0] * num_experts
    for row in ids:
        for e in row:
            if 0 <= e < num_experts:
                counts[e] += 1
    starts, running = [], 0
    for c in counts:
        starts.append(running)
        running += c
    ends = [s + c for s, c in zip(starts, counts)]
    total = tokens * k
    locations = [[total] * tokens for _ in range(k)]
    sorted_ids = [num_experts] * total
    slot_choices = [None] * total
    dropped = running  # the dropped choices fill the slots after the kept ones, in choice order
    for t in range(tokens):
        for j in range(k):
            e = ids[t][j]
            if 0 <= e < num_experts:
                slot = starts[e]
                starts[e] += 1
                locations[j][t] = slot
                sorted_ids[slot] = e
            else:
                slot = dropped
                dropped += 1
            slot_choices[slot] = t * k + j
    return locations, slot_choices, sorted_ids, counts, ends


def _plan_with_composite(expert_ids: torch.Tensor, num_experts: int):
    with use_operators("composite"):
        return plan_routing(expert_ids, num_experts)


IMPLEMENTATIONS = {"operator": plan_routing, "tensor_ops": _plan_with_composite}


def check_plan(implementation, expert_ids, num_experts):
    plan = IMPLEMENTATIONS[implementation](expert_ids, num_experts)
    locations, slot_choices, sorted_ids, counts, ends = reference_plan(expert_ids, num_experts)
    tokens, k = expert_ids.shape
    assert plan.locations.dtype == torch.int32 and plan.locations.shape == (k, tokens)
    assert plan.locations.tolist() == locations
    assert plan.slot_choices.dtype == torch.int64 and plan.slot_choices.tolist() == slot_choices
    assert plan.sorted_ids.dtype == torch.int64 and plan.sorted_ids.tolist() == sorted_ids
    assert plan.counts.dtype == torch.int64 and plan.counts.tolist() == counts
    assert plan.offsets.dtype == torch.int32 and plan.offsets.tolist() == ends
    assert plan.indices is None  # the grouped layout: encode / decode name expert 0 without a table


@pytest.mark.parametrize("implementation", list(IMPLEMENTATIONS))
@pytest.mark.parametrize("tokens,k,experts", [(0, 2, 4), (1, 1, 1), (1, 8, 64), (7, 3, 5), (33, 8, 65),
                                              (129, 2, 8), (300, 5, 17)])
@pytest.mark.parametrize("id_dtype", [torch.int64, torch.int32, torch.int16])
def test_matches_the_definition(implementation, tokens, k, experts, id_dtype):
    generator = torch.Generator().manual_seed(tokens * 100 + k * 10 + experts)
    # ids in [-2, E + 2): some choices dropped on both sides; idle experts at every size here
    expert_ids = torch.randint(-2, experts + 2, (tokens, k), generator=generator).to(id_dtype)
    check_plan(implementation, expert_ids, experts)


@pytest.mark.parametrize("implementation", list(IMPLEMENTATIONS))
def test_all_dropped_and_one_expert_for_all(implementation):
    check_plan(implementation, torch.full((5, 3), 9), 4)
    check_plan(implementation, torch.full((5, 3), 2), 4)


def test_operator_refuses_bad_arguments():
    with pytest.raises(ValueError, match="expert_ids"):
        torch.ops.tutel.group_by_expert(torch.zeros(4, dtype=torch.int64), 3)
    with pytest.raises(TypeError, match="integers"):
        torch.ops.tutel.group_by_expert(torch.zeros(4, 2), 3)
    with pytest.raises(ValueError, match="num_experts"):
        torch.ops.tutel.group_by_expert(torch.zeros(4, 2, dtype=torch.int64), 0)


def test_operator_registration_passes_opcheck():
    expert_ids = torch.tensor([[3, 1], [1, 5], [0, 3]])
    torch.library.opcheck(torch.ops.tutel.group_by_expert.default, (expert_ids, 4),
                          test_utils=("test_schema", "test_faketensor"))
