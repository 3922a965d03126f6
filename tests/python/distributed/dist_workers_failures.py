"""Ranks that stop before a collective: the others must fail with CollectiveError, never hang."""
import os
import sys
import time

import torch

from dist_harness import init_gloo
from tutel import net


def _report(started: float, action) -> None:
    try:
        action()
    except net.CollectiveError as error:
        print(f"CollectiveError after {time.monotonic() - started:.1f} s: {error}", flush=True)
    else:
        raise AssertionError("the collective succeeded although a peer never joined it")


def _has_exited(pid: int) -> bool:
    """Whether process `pid` (on this host) has exited: gone, or a zombie not yet reaped."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def peer_exits_before_a_collective() -> None:
    """Rank 1 exits; once it has (an event, not a sleep), rank 0 all-reduces over WORLD."""
    init_gloo()
    peer_pid = int(net.simple_all_reduce(torch.tensor([os.getpid() if net.get_world_rank() == 1 else 0]))[0])
    if net.get_world_rank() == 1:
        sys.stdout.flush()
        os._exit(0)
    deadline = time.monotonic() + 60  # generous: only a broken run waits this long
    while not _has_exited(peer_pid):
        if time.monotonic() > deadline:
            raise AssertionError(f"rank 1 (pid {peer_pid}) did not exit")
        time.sleep(0.05)
    _report(time.monotonic(), lambda: net.simple_all_reduce(torch.ones(4)))


def peer_hangs_before_a_collective(done_directory: str) -> None:
    """Ranks 1 and 3 stay alive without joining; rank 0 all-reduces over the model group {0, 1}, rank 2
    waits for a background all-to-all over {2, 3}.  Both groups come from create_groups_from_world."""
    env = init_gloo(group_count=2)
    rank = net.get_world_rank()
    marker = os.path.join(done_directory, f"done-{rank}")
    if rank in (1, 3):
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not all(
                os.path.exists(os.path.join(done_directory, f"done-{peer}")) for peer in (0, 2)):
            time.sleep(0.1)
        return
    started = time.monotonic()
    if rank == 0:
        _report(started, lambda: net.simple_all_reduce(torch.ones(4), group=env.model_group))
    else:
        output, wait = net.simple_all_to_all(torch.ones([2, 3]), group=env.model_group, background=True)
        _report(started, wait)
    open(marker, "w").close()
