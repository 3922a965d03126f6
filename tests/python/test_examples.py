"""The example scripts run with few steps on the CPU and print Tutel's lines."""
import re
import subprocess
import sys

import pytest

SMALL = ["--device", "cpu", "--batch_size", "2", "--num_tokens", "32", "--model_dim", "16", "--num_steps", "6"]
STEP = re.compile(r"^STEP-(\d+): loss = ([0-9.]+), step_time = ([0-9.]+) sec(?:, perf = ([0-9.]+) tflops\.)?", re.M)
SUMMARY = re.compile(r"^\[Summary\] Average synchronized step_time = ([0-9.e-]+) sec\.$", re.M)


def run_example(name, *args):
    result = subprocess.run([sys.executable, "-m", f"tutel.examples.{name}", *args], capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def losses(stdout):
    steps = STEP.findall(stdout)
    assert [int(s[0]) for s in steps] == list(range(len(steps))) and steps, stdout
    return [float(s[1]) for s in steps]


def test_helloworld_prints_tutel_lines_and_loss_falls(tmp_path):
    checkpoint = str(tmp_path / "ckpt-{rank}-of-{size}.pt")
    out = run_example("helloworld", *SMALL, "--hidden_size", "24", "--num_local_experts", "3",
                      "--checkpoint_path", checkpoint)
    assert "[Statistics] param count for MoE local_experts = " in out
    assert ("[Benchmark] world_size = 1, dtype = float32, model_dim = 16, hidden_size = 24, samples = 64, "
            "num_local_experts = 3, topK = 2, a2a_ffn_overlap_degree = 1, parallel_type = `adaptive:1`, "
            "device = `cpu`") in out
    assert "Top-K(s) = ['k=2, noise=0.0'], Total-Experts = 3 [managed by 1 device(s)]," in out
    values = losses(out)
    assert all(later < earlier for earlier, later in zip(values, values[1:])), values
    assert SUMMARY.search(out)
    assert (tmp_path / "ckpt-0-of-1.pt").exists()
    # a second run resumes from the checkpoint: its first loss continues the fall
    resumed = losses(run_example("helloworld", *SMALL, "--hidden_size", "24", "--num_local_experts", "3",
                                 "--checkpoint_path", checkpoint))
    assert resumed[0] < values[-1]


@pytest.mark.parametrize("extra", [["--dtype", "bfloat16", "--fp32_gate"], ["--dtype", "float64", "--eval"],
                                   ["--capacity_factor", "0", "--megablocks_size", "2", "--top", "1"],
                                   ["--expert_type", "llama_ffn", "--l_aux_wt", "0.01"]])
def test_helloworld_options(extra):
    values = losses(run_example("helloworld", *SMALL, "--hidden_size", "24", *extra))
    assert len(values) == 6


def test_helloworld_switch_cycles_settings():
    out = run_example("helloworld_switch", *SMALL, "--hidden_size", "24", "--num_steps", "10", "--switch_top_k",
                      "--switch_capacity")
    settings = re.findall(r"\(f = (-?[0-9.]+), r = (\d+), o = (\d+)\) \(k = (\d)\)", out)
    assert len(settings) == 10
    assert [int(s[2]) for s in settings] == [8, 1, 2, 3, 4, 5, 6, 7, 8, 1]
    assert {s[0] for s in settings} == {"1.0", "0.0", "-1.0"} and {s[3] for s in settings} == {"1", "2"}


def test_custom_gate_expert_example_logs_options():
    result = subprocess.run([sys.executable, "-m", "tutel.examples.helloworld_custom_gate_expert", *SMALL],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "CustomExpert received option my_activ_type = relu" in result.stderr
    assert "CustomGate received option top_k = 2" in result.stderr
    assert re.search(r"^STEP-5: loss = [0-9.]+, step_time = [0-9.]+ sec\.$", result.stdout, re.M)


def test_from_scratch_and_amp_examples():
    out = run_example("helloworld_from_scratch", "--device", "cpu", "--num_samples", "128", "--model_dim", "16",
                      "--num_steps", "4")
    assert len(re.findall(r"^STEP-\d+: loss = [0-9.]+, step_time = [0-9.]+ s$", out, re.M)) == 4
    values = losses(run_example("helloworld_amp", *SMALL, "--hidden_size", "24"))
    assert values[-1] < values[0]
