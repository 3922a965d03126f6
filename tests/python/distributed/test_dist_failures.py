"""A rank that stops before a collective makes its peers fail quickly with CollectiveError, never hang."""
import re

from dist_harness import launch

TIMEOUT_SEC = 5


def _failure_seconds(stdout: str) -> float:
    match = re.search(r"CollectiveError after ([0-9.]+) s: (.*)", stdout)
    assert match, f"no CollectiveError reported in:\n{stdout}"
    assert f"TUTEL_GLOBAL_TIMEOUT_SEC={TIMEOUT_SEC} s" in match.group(2), match.group(2)
    return float(match.group(1))


def test_peer_that_exits_makes_the_collective_fail_at_once():
    result = launch("dist_workers_failures:peer_exits_before_a_collective", 2,
                    env={"TUTEL_GLOBAL_TIMEOUT_SEC": str(TIMEOUT_SEC)}, timeout=60).check()
    assert "tutel.net.simple_all_reduce" in result.ranks[0].stdout
    assert _failure_seconds(result.ranks[0].stdout) < TIMEOUT_SEC


def test_peer_that_hangs_makes_the_collective_time_out(tmp_path):
    # Groups created by create_groups_from_world carry the timeout; the background
    # all-to-all's wait() times out as well as a blocking all-reduce.
    result = launch("dist_workers_failures:peer_hangs_before_a_collective", 4,
                    env={"TUTEL_GLOBAL_TIMEOUT_SEC": str(TIMEOUT_SEC)}, args=(str(tmp_path),), timeout=90).check()
    for rank, collective in ((0, "simple_all_reduce"), (2, "simple_all_to_all")):
        stdout = result.ranks[rank].stdout
        assert f"tutel.net.{collective}" in stdout
        assert TIMEOUT_SEC - 1 <= _failure_seconds(stdout) < 4 * TIMEOUT_SEC, stdout
    assert result.elapsed < 60
