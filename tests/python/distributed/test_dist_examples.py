"""The distributed examples under torchrun on CPU (gloo): they run and print the expected values."""
import re
import sys

import pytest

from dist_harness import run_command


def _torchrun(module: str, *args: str, processes: int = 2):
    output = run_command([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          f"--nproc_per_node={processes}", "-m", module, *args], timeout=180)
    assert output.returncode == 0, output.describe()
    return output


def _received(stdout: str) -> dict:
    """{rank: received values} from the `Device-R recvs: [tensor([...])]` lines."""
    found = re.findall(r"Device-(\d) recvs: \[tensor\(\[([0-9, ]*)\]\)\]", stdout)
    return {int(rank): [int(value) for value in values.split(",")] for rank, values in found}


def test_bandwidth_test_prints_every_collective_every_loop():
    output = _torchrun("tutel.examples.bandwidth_test", "--device", "cpu", "--size_mb", "1", "--loop", "2")
    lines = re.findall(r"^(\w+) bandwidth across 2 node\(s\) = ([0-9.]+) GB/s$", output.stdout, re.MULTILINE)
    assert [name for name, _ in lines] == ["AllToAll", "AllReduce", "AllGather", "ReduceScatter"] * 2, output.stdout
    assert all(float(value) > 0 for _, value in lines)


@pytest.mark.parametrize("module, expected", [
    ("tutel.examples.nccl_all_to_all_v", {0: [10, 20, 20], 1: [10, 10, 10, 10, 20]}),
    ("tutel.examples.nccl_all_gather_v", {0: [10] * 5 + [20] * 3, 1: [10] * 5 + [20] * 3}),
])
def test_variable_size_examples(module, expected):
    output = _torchrun(module)
    assert _received(output.stdout) == expected, output.stdout
    assert "Device-0 sends: [tensor([10, 10, 10, 10, 10])]" in output.stdout
    assert "Device-1 sends: [tensor([20, 20, 20])]" in output.stdout
