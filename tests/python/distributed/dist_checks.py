"""Shared pieces of the checks that run inside the ranks of a launch."""
from typing import Callable, List, Optional, Sequence

import torch

import dist_reference as ref
from tutel import net


class CheckList(list):
    """Check functions in registration order; ``@checks.add`` registers one."""

    def add(self, function: Callable[[], None]) -> Callable[[], None]:
        self.append(function)
        return function

    def names(self) -> List[str]:
        return [function.__name__ for function in self]


def run(check_lists: Sequence[CheckList]) -> None:
    """Runs every check in order, printing ``ok <name>`` after each (the tests look for every name)."""
    for checks in check_lists:
        for function in checks:
            function()
            print(f"ok {function.__name__}", flush=True)


def world() -> int:
    return net.get_world_size()


def rank() -> int:
    return net.get_world_rank()


def close(actual: torch.Tensor, expected: torch.Tensor, what: str, tol: float = 1e-12) -> None:
    torch.testing.assert_close(actual, expected, rtol=tol, atol=tol, msg=lambda m: f"{what} (rank {rank()}): {m}")


def expect_error(error: type, words: Sequence[str], function: Callable, *args, **kwargs) -> None:
    """Asserts that function(*args, **kwargs) raises ``error`` whose message contains every word."""
    try:
        function(*args, **kwargs)
    except error as raised:
        message = str(raised)
        missing = [word for word in words if word not in message]
        assert not missing, f"message {message!r} lacks {missing}"
        return
    raise AssertionError(f"{getattr(function, '__name__', function)} did not raise {error.__name__}")


def compare_with_reference(name: str, make_input: Callable[[int], torch.Tensor],
                           distributed: Callable[[torch.Tensor], torch.Tensor],
                           reference: Callable[[List[torch.Tensor]], List[torch.Tensor]],
                           replicated_input: bool = False, single_loss: bool = False,
                           group_ranks: Optional[List[int]] = None) -> None:
    """Checks a collective's output and input gradient against the float64 reference.

    Every member r of the group holds ``make_input(r)`` (or, with
    ``replicated_input``, the same ``make_input(0)``: one logical tensor) and the
    loss ``<y_r, g_r>``.  The expected gradient is that of the sum of the losses
    over the members, or, with ``single_loss`` (a replicated output), of the one
    loss ``<y, g>`` that every rank holds.
    """
    members = group_ranks if group_ranks is not None else list(range(world()))
    me = members.index(rank())
    size = len(members)
    inputs = [make_input(0 if replicated_input else index) for index in range(size)]
    x = inputs[me].clone().requires_grad_()
    y = distributed(x)
    if replicated_input:
        leaf = inputs[0].clone().requires_grad_()
        leaves = [leaf] * size
    else:
        leaves = [value.clone().requires_grad_() for value in inputs]
    expected = reference(leaves)
    close(y, expected[me], f"{name} forward")
    grads = [ref.seeded(f"{name}/grad", 0 if single_loss else index, expected[index].shape) for index in range(size)]
    (y * grads[me]).sum().backward()
    if single_loss:
        total = (expected[0] * grads[0]).sum()
    else:
        total = sum((out * grad).sum() for out, grad in zip(expected, grads))
    total.backward()
    close(x.grad, leaves[me].grad, f"{name} gradient")


def side_channel() -> "torch.distributed.TCPStore":
    """A key-value store shared by the ranks, outside the process groups under test: rank 0 serves
    it on a port the system picks, and the others learn the port through an all-reduce.  Lets a
    check signal between ranks while a collective is in flight (an event, instead of a sleep)."""
    import torch.distributed as dist
    server = dist.TCPStore("127.0.0.1", 0, world(), True, wait_for_workers=False) if rank() == 0 else None
    port = int(net.simple_all_reduce(torch.tensor([server.port if server else 0]))[0])
    return server or dist.TCPStore("127.0.0.1", port, world(), False)

