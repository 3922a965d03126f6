"""tutel.ops.encode_grouped: a routing plan's grouped rows copied from the tokens (one launch of
tutel::choice_rows), and its gradient, each token's kept rows summed (gather_slots without
weights), against a reference written out here from the plan's documented meaning."""
import pytest
import torch

from tutel import ops
from tutel.paths.plans import plan_routing

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
TOLERANCE = {torch.float32: (1e-6, 1e-6), torch.float64: (1e-12, 1e-12), torch.bfloat16: (1e-2, 1e-2),
             torch.float16: (2e-3, 2e-3)}


def _ids(tokens, k, experts, generator):
    """[T, k] expert ids, some outside [0, E) (dropped), repeated ones allowed."""
    ids = torch.randint(-1, experts + 1, (tokens, k), generator=generator)
    return ids


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens,k,experts", [(0, 2, 3), (1, 1, 1), (5, 3, 2), (37, 4, 9), (64, 8, 70)])
def test_rows_and_gradient_follow_the_plan(dtype, tokens, k, experts):
    g = torch.Generator().manual_seed(tokens * 100 + k * 10 + experts)
    x = torch.randn(tokens, 13, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    plan = plan_routing(_ids(tokens, k, experts, g), experts)
    rows = ops.encode_grouped(x, plan.slot_choices, plan.locations)
    slots = tokens * k
    assert rows.shape == (slots, 13) and rows.dtype == dtype
    # Row s holds the token of the choice t * k + j that the plan puts there (dropped ones too).
    for s in range(slots):
        assert torch.equal(rows[s], x[int(plan.slot_choices[s]) // k])
    # Each token's gradient: the sum of the rows of its kept choices (location below T * k).
    grad_rows = torch.randn(slots, 13, generator=g, dtype=torch.float64)
    want = torch.zeros(tokens, 13, dtype=torch.float64)
    for j in range(k):
        for t in range(tokens):
            slot = int(plan.locations[j, t])
            if slot < slots:
                want[t] += grad_rows[slot].to(dtype).double()
    got, = torch.autograd.grad(rows, x, grad_rows.to(dtype))
    rtol, atol = TOLERANCE[dtype]
    torch.testing.assert_close(got.double(), want, rtol=rtol, atol=atol)


def test_a_row_strided_x_is_read_in_place():
    g = torch.Generator().manual_seed(3)
    wide = torch.randn(9, 20, generator=g)
    x = wide[:, 2:15]
    plan = plan_routing(torch.randint(0, 4, (9, 2), generator=g), 4)
    rows = ops.encode_grouped(x, plan.slot_choices, plan.locations)
    assert torch.equal(rows, x[plan.slot_choices // 2])
