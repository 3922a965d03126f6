"""The MoE layer on 2 and 4 real processes (gloo) equals the single-process float64 reference:
expert parallelism, sharded experts with every adaptive_r, overlap degrees, 2DH, dropless,
different token counts per rank, llama_ffn experts and bad configurations."""
import pytest

from dist_checks_layer import checks
from dist_harness import launch


@pytest.mark.parametrize("world_size, env", [(2, {}), (4, {"LOCAL_SIZE": "2"})],
                         ids=["2 ranks", "4 ranks, LOCAL_SIZE=2"])
def test_layer_checks_pass_on_every_rank(world_size, env):
    result = launch("dist_checks_layer:run_all", world_size, env=env, timeout=400).check()
    for rank, output in enumerate(result.ranks):
        missing = [name for name in checks.names() if f"ok {name}\n" not in output.stdout]
        assert not missing, f"rank {rank} did not run {missing}\n{output.describe()}"
