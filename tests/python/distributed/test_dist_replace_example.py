"""tutel.examples.transformers_replace_ep: a tiny transformers MoE model trained with
replace_moe_blocks, on one process and with its experts split over 2 processes (torchrun, gloo);
the loss falls in both."""
import re
import sys

from dist_harness import run_command


def _losses(stdout: str):
    return [float(value) for value in re.findall(r"^step +\d+  loss ([0-9.]+)$", stdout, re.MULTILINE)]


def test_trains_with_expert_parallel_under_torchrun():
    output = run_command([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                          "-m", "tutel.examples.transformers_replace_ep", "--steps", "16"], timeout=300)
    assert output.returncode == 0, output.describe()
    assert "replaced 2 MoE blocks by moe_layers; 2 process(es), 4 of 8 experts each" in output.stdout, output.stdout
    losses = _losses(output.stdout)
    assert len(losses) == 4 and losses[-1] < 0.7 * losses[0], output.stdout
    assert "loss fell from" in output.stdout


def test_trains_on_one_process():
    from tutel.examples import transformers_replace_ep
    losses = transformers_replace_ep.main(["--family", "mixtral", "--steps", "12"])
    assert len(losses) == 12 and losses[-1] < 0.8 * losses[0]
