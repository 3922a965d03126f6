"""replace_moe_blocks with expert parallelism on 2 real processes (gloo) equals one process, for
every supported transformers family (checks in dist_checks_replace.py)."""
from dist_checks_replace import checks
from dist_harness import launch


def test_replaced_models_are_expert_parallel_and_equal_one_process():
    result = launch("dist_checks_replace:run_all", 2, timeout=400).check()
    for rank, output in enumerate(result.ranks):
        missing = [name for name in checks.names() if f"ok {name}\n" not in output.stdout]
        assert not missing, f"rank {rank} did not run {missing}\n{output.describe()}"
