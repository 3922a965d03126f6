"""python3 -m tutel.checkpoint.gather / scatter on files: Tutel's flags and printed lines,
checkpoints nested in a namespace, and clear errors."""
import subprocess
import sys

import torch

from checkpoint_models import build_model, mismatches, outputs, tokens


def _run(module, *args):
    return subprocess.run([sys.executable, "-m", f"tutel.checkpoint.{module}", *args], capture_output=True, text=True,
                          timeout=120)


def test_scatter_then_gather_through_a_namespace(tmp_path):
    model = build_model(1)
    torch.save({"model": {"weights": model.state_dict()}, "epoch": 7}, tmp_path / "all.pt")
    pattern = str(tmp_path / "parts" / "model-{rank}-of-{size}.pt")
    scattered = _run("scatter", f"--input={tmp_path / 'all.pt'}", "--output_size=8", f"--outputs={pattern}",
                     "--namespace=model/weights")
    assert scattered.returncode == 0, scattered.stderr
    files = [pattern.format(rank=r, size=8) for r in range(8)]
    assert scattered.stdout.splitlines() == [f"Model params have been scattered to: {f}" for f in files]
    part = torch.load(files[5])
    assert part["epoch"] == 7 and part["model"]["weights"]["ffn_e4.experts.batched_fc1_w"].shape == (1, 4, 6)

    gathered = _run("gather", f"--inputs={pattern}", "--input_size=8", f"--output={tmp_path / 'back.pt'}",
                    "--namespace=model/weights")
    assert gathered.returncode == 0, gathered.stderr
    assert gathered.stdout.strip() == f"Model params have been collected to: {tmp_path / 'back.pt'}"
    back = torch.load(tmp_path / "back.pt")
    assert back["epoch"] == 7
    resumed = build_model(1, seed=3)
    resumed.load_state_dict(back["model"]["weights"])
    assert not mismatches(outputs(resumed, tokens()), outputs(model, tokens()))


def test_errors_exit_with_a_message(tmp_path):
    model = build_model(1)
    torch.save(model.state_dict(), tmp_path / "all.pt")
    bad_size = _run("scatter", f"--input={tmp_path / 'all.pt'}", "--output_size=3", f"--outputs={tmp_path}/r{{rank}}.pt")
    assert bad_size.returncode == 1 and "4 experts cannot be placed on 3 processes" in bad_size.stderr
    missing = _run("gather", f"--inputs={tmp_path}/none-{{rank}}.pt", "--input_size=2", f"--output={tmp_path}/x.pt")
    assert missing.returncode == 1 and "no checkpoint file was found" in missing.stderr
    no_rank = _run("gather", f"--inputs={tmp_path}/all.pt", "--input_size=2", f"--output={tmp_path}/x.pt")
    assert no_rank.returncode == 1 and "has no `{rank}`" in no_rank.stderr
    bad_namespace = _run("scatter", f"--input={tmp_path / 'all.pt'}", "--output_size=2",
                         f"--outputs={tmp_path}/r{{rank}}.pt", "--namespace=model")
    assert bad_namespace.returncode == 1 and "no entry 'model' under the top level" in bad_namespace.stderr
