"""The MoE examples under torchrun on 2 CPU processes (gloo)."""
import re
import sys

from dist_harness import run_command

TINY = ["--device", "cpu", "--batch_size", "2", "--num_tokens", "32", "--model_dim", "16", "--hidden_size", "24",
        "--num_steps", "4"]


def torchrun(module, *args, processes=2):
    output = run_command([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          f"--nproc_per_node={processes}", "-m", module, *args], timeout=240)
    assert output.returncode == 0, output.describe()
    return output.stdout


def losses(stdout):
    return [float(v) for v in re.findall(r"^STEP-\d+: loss = ([0-9.]+),", stdout, re.M)]


def test_data_parallel_variants_train_identically():
    """Manual gradient all-reduce, PyTorch DDP and TutelDistributedOptimizer give the same losses."""
    manual = torchrun("tutel.examples.helloworld", *TINY)
    assert "Total-Experts = 4 [managed by 2 device(s)]" in manual
    ddp = torchrun("tutel.examples.helloworld_ddp", *TINY)
    zero = torchrun("tutel.examples.helloworld_ddp_tutel", *TINY)
    values = losses(manual)
    assert len(values) == 4 and all(b < a for a, b in zip(values, values[1:])), manual
    assert losses(ddp) == values and losses(zero) == values
    assert len(re.findall(r"^STEP-\d+", manual, re.M)) == 4, "only rank 0 prints"


def test_switch_example_cycles_every_r_on_sharded_experts():
    out = torchrun("tutel.examples.helloworld_switch", *TINY[:-2], "--num_steps", "24", "--num_local_experts", "-2")
    settings = re.findall(r"\(f = [-0-9.]+, r = (\d+), o = (\d+)\)", out)
    assert {r for r, _ in settings} == {"0", "1", "2"} and len(settings) == 24
    assert "Total-Experts = 1 [managed by 2 device(s)]" in out
