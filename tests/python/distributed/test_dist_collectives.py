"""Every tutel.net collective, its gradient, the optimizer, groups and 2DH on 2 and 4 real processes (gloo).

The checks themselves (dist_checks_*.py) compare each rank's result with a
single-process float64 computation over the inputs of all ranks; this file
launches them and verifies that every check ran and passed on every rank.
"""
import pytest

from dist_harness import launch
from dist_suite import check_names


@pytest.mark.parametrize("world_size, env", [(2, {}), (4, {"LOCAL_SIZE": "2"})],
                         ids=["2 ranks", "4 ranks, LOCAL_SIZE=2 (2DH over 2 hosts)"])
def test_every_check_passes_on_every_rank(world_size, env):
    result = launch("dist_suite:run_all", world_size, env=env, timeout=300).check()
    for rank, output in enumerate(result.ranks):
        missing = [name for name in check_names() if f"ok {name}\n" not in output.stdout]
        assert not missing, f"rank {rank} did not run {missing}\n{output.describe()}"
        assert f"Registering device global rank {rank}: data_rank = 0, model_rank = {rank}" in output.stderr
        assert ("dist_print from rank 0" in output.stdout) == (rank == 0), "dist_print prints on rank 0 only"
