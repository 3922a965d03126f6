"""Checks that TutelDistributedOptimizer equals the plain optimizer on the full parameters."""
import torch

import dist_reference as ref
from dist_checks import CheckList, close, rank, world
from tutel import net

checks = CheckList()

# name -> (shape, dtype, is_expert, ranks that have a gradient (None: all))
PARAMS = {
    "weight": ([5, 3], torch.float64, False, None),
    "odd": ([7], torch.float64, False, None),           # 7 elements: padded shards
    "tiny": ([1], torch.float64, False, None),          # fewer elements than ranks
    "fp32": ([4, 2], torch.float32, False, None),       # a second (dtype) buffer
    "partial": ([3, 3], torch.float64, False, [0]),     # a gradient on rank 0 only
    "unused": ([2], torch.float64, False, []),          # no gradient anywhere: skipped
    "expert": ([3, 2], torch.float64, True, None),
    "allreduce_skipped": ([2, 2], torch.float64, True, None),
}


def _initial(name: str, owner: int) -> torch.Tensor:
    shape, dtype, _, _ = PARAMS[name]
    return ref.seeded(f"param/{name}", owner, shape, dtype)


def _grad(name: str, source: int, step: int):
    shape, dtype, _, has_grad = PARAMS[name]
    if has_grad is not None and source not in has_grad:
        return None
    return ref.seeded(f"grad/{name}/{step}", source, shape, dtype)


def _distributed_params():
    params = {}
    for name, (_, _, is_expert, _) in PARAMS.items():
        param = torch.nn.Parameter(_initial(name, rank() if is_expert else 0))
        if name == "expert":
            param._tutel_expert = True
        elif name == "allreduce_skipped":
            param.skip_allreduce = True
        params[name] = param
    return params


def _reference_params():
    """Full parameters of the plain optimizer, with the gradients the distributed one reduces."""
    return {name: torch.nn.Parameter(_initial(name, rank() if is_expert else 0))
            for name, (_, _, is_expert, _) in PARAMS.items()}


def _accumulate(param: torch.Tensor, grad) -> None:
    """Adds `grad` into param.grad the way backward() does (a None gradient adds nothing)."""
    if grad is None:
        return
    if param.grad is None:
        param.grad = grad.clone()
    else:
        param.grad.add_(grad)


def _set_reference_grads(params, step: int, average: bool, members) -> None:
    """The gradients the distributed optimizer should see: experts' own, shared ones summed (or
    averaged) over the ranks of `members`, its group."""
    for name, param in params.items():
        is_expert = PARAMS[name][2]
        if is_expert:
            _accumulate(param, _grad(name, rank(), step))
            continue
        grads = [_grad(name, source, step) for source in members]
        present = [grad for grad in grads if grad is not None]
        _accumulate(param, None if not present else sum(present) / (len(members) if average else 1))


def _compare(optimizer_class, average: bool, group=None, members=None, set_to_none: bool = True,
             **options) -> None:
    """Three steps of the distributed optimizer over `group` (whose global ranks are `members`,
    default: every rank) against the plain optimizer on the full parameters."""
    members = list(range(world())) if members is None else members
    params = _distributed_params()
    optimizer = net.TutelDistributedOptimizer(params.values(), group=group, average_shared=average)
    assert optimizer.warp_local(optimizer_class, **options) is optimizer
    expected = _reference_params()
    plain = optimizer_class(expected.values(), **options)
    for step in range(3):
        for name, param in params.items():
            _accumulate(param, _grad(name, rank(), step))
        optimizer.step()
        optimizer.zero_grad(set_to_none=set_to_none)
        _set_reference_grads(expected, step, average, members)
        plain.step()
        plain.zero_grad(set_to_none=set_to_none)
        what = f"{optimizer_class.__name__} (group {members}, set_to_none={set_to_none})"
        for name, param in params.items():
            tol = 1e-6 if param.dtype == torch.float32 else 1e-12
            close(param.detach(), expected[name].detach(), f"{what} {name} step {step}", tol)
            assert param.grad is None if set_to_none else (param.grad is None or not param.grad.any()), name
    close(params["unused"].detach(), _initial("unused", 0), "a parameter without gradients must not move")


@checks.add
def distributed_optimizer_equals_plain_sgd_and_adam():
    _compare(torch.optim.SGD, average=True, lr=0.1, momentum=0.9)
    _compare(torch.optim.SGD, average=False, lr=0.05, weight_decay=0.01)
    _compare(torch.optim.Adam, average=True, lr=0.01)
    _compare(torch.optim.AdamW, average=False, lr=0.02, weight_decay=0.1)


@checks.add
def distributed_optimizer_keeps_zeroed_gradients():
    """zero_grad(set_to_none=False) zeroes the gradients in place; the next backward adds to them."""
    _compare(torch.optim.SGD, average=True, set_to_none=False, lr=0.1, momentum=0.9)
    _compare(torch.optim.AdamW, average=False, set_to_none=False, lr=0.02, weight_decay=0.1)


@checks.add
def distributed_optimizer_on_a_subgroup():
    """Ranks {0, 1} and {2, 3} (or {0, 1} alone) each run their own optimizer: shared gradients
    are reduced within the pair only."""
    pairs = [list(range(start, min(start + 2, world()))) for start in range(0, world(), 2)]
    groups = [torch.distributed.new_group(pair) for pair in pairs]  # every rank creates every group
    mine = rank() // 2
    _compare(torch.optim.SGD, average=True, group=groups[mine], members=pairs[mine], lr=0.1, momentum=0.9)
    _compare(torch.optim.Adam, average=False, group=groups[mine], members=pairs[mine], lr=0.01)


@checks.add
def distributed_optimizer_shards_the_state():
    params = _distributed_params()
    optimizer = net.TutelDistributedOptimizer(params.values()).warp_local(torch.optim.Adam, lr=0.1)
    shared = [name for name, spec in PARAMS.items() if not spec[2]]
    sharded = sum(-(-params[name].numel() // world()) for name in shared)
    experts = sum(params[name].numel() for name, spec in PARAMS.items() if spec[2])
    held = sum(p.numel() for group in optimizer.param_groups for p in group["params"])
    assert held == sharded + experts, (held, sharded, experts)
    try:
        net.TutelDistributedOptimizer([{"params": []}])
    except TypeError as error:
        assert "parameter groups" in str(error)
    else:
        raise AssertionError("a parameter group must be rejected with TypeError")
