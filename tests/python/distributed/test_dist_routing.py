"""Scored routing on 2 real processes (gloo): expert parallel equals the float64 reference, and the
aux-loss-free selection bias stays identical on both and equals the one-process update."""
from dist_checks_routing import checks
from dist_harness import launch


def test_scored_routing_checks_pass_on_every_rank():
    result = launch("dist_checks_routing:run_all", 2, timeout=300).check()
    for rank, output in enumerate(result.ranks):
        missing = [name for name in checks.names() if f"ok {name}\n" not in output.stdout]
        assert not missing, f"rank {rank} did not run {missing}\n{output.describe()}"
