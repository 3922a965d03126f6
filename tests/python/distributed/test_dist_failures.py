"""A rank that stops before a collective makes its peers fail with CollectiveError, never hang.

No wall-clock bound on the machine's speed: a peer that exited must fail the collective without
waiting for the timeout (set far above the launch's own time limit), and a peer that hangs must
make it fail at the timeout (a lower bound, which a slow machine cannot break)."""
import re

from dist_harness import launch

TIMEOUT_SEC = 5           # a hanging peer: the collective waits this long, then fails
EXIT_TIMEOUT_SEC = 3600   # an exited peer: far above the launch limit, so waiting for it fails the launch


def _failure_seconds(stdout: str, timeout: int) -> float:
    match = re.search(r"CollectiveError after ([0-9.]+) s: (.*)", stdout)
    assert match, f"no CollectiveError reported in:\n{stdout}"
    assert f"TUTEL_GLOBAL_TIMEOUT_SEC={timeout} s" in match.group(2), match.group(2)
    return float(match.group(1))


def test_peer_that_exits_makes_the_collective_fail_at_once():
    result = launch("dist_workers_failures:peer_exits_before_a_collective", 2,
                    env={"TUTEL_GLOBAL_TIMEOUT_SEC": str(EXIT_TIMEOUT_SEC)}, timeout=120).check()
    assert "tutel.net.simple_all_reduce" in result.ranks[0].stdout
    _failure_seconds(result.ranks[0].stdout, EXIT_TIMEOUT_SEC)  # reported, and before the launch limit


def test_peer_that_hangs_makes_the_collective_time_out(tmp_path):
    # Groups created by create_groups_from_world carry the timeout; the background
    # all-to-all's wait() times out as well as a blocking all-reduce.
    result = launch("dist_workers_failures:peer_hangs_before_a_collective", 4,
                    env={"TUTEL_GLOBAL_TIMEOUT_SEC": str(TIMEOUT_SEC)}, args=(str(tmp_path),), timeout=120).check()
    for rank, collective in ((0, "simple_all_reduce"), (2, "simple_all_to_all")):
        stdout = result.ranks[rank].stdout
        assert f"tutel.net.{collective}" in stdout
        assert _failure_seconds(stdout, TIMEOUT_SEC) >= TIMEOUT_SEC - 1, stdout  # it did wait for the timeout
