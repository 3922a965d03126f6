"""Checkpoints move between world sizes bit-exactly: 1 -> 2 -> 4 -> 1 and 4 -> 2 processes, for
whole and shared experts (ffn with and without biases, output_dim != model_dim, llama_ffn).

1. One process builds the model, records its outputs on fixed tokens and saves a gathered
   checkpoint; the library also scatters it into the files of 2 and 4 processes.
2. Two processes load the gathered file (load_state_dict and load_resharded) and the 4-process
   files (load_resharded); outputs must equal the one-process model's bit for bit; they save
   their own files, which must equal the scattered ones bit for bit.
3. Four processes load those 2-process files; same checks; they save theirs.
4. The gather command line merges the 4 files back into one, equal to the original.
"""
import os
import subprocess
import sys

import torch

from checkpoint_models import build_model, mismatches, outputs, tokens
from dist_harness import REPO_ROOT, clean_environment, launch
from tutel import checkpoint


def _same_states(a, b):
    assert list(a) == list(b)
    return [key for key in a if not (a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]))]


def test_round_trips_between_1_2_and_4_processes(tmp_path):
    directory = str(tmp_path)
    path = lambda name: os.path.join(directory, name)  # noqa: E731
    original = build_model(1)
    expected = outputs(original, tokens())
    torch.save(expected, path("expected.pt"))
    state = original.state_dict()
    torch.save(state, path("global.pt"))
    for world in (2, 4):
        for rank, part in enumerate(checkpoint.scatter_state_dict(state, world)):
            torch.save(part, path(f"w{world}s-{rank}.pt"))

    two = launch("dist_checks_checkpoint:two_ranks", 2, args=(directory,), timeout=120).check()
    for output in two.ranks:
        for what in ("1 -> 2 load_state_dict(gathered)", "1 -> 2 load_resharded", "4 -> 2 load_resharded",
                     "refusals"):
            assert f"ok {what}\n" in output.stdout, output.describe()
    four = launch("dist_checks_checkpoint:four_ranks", 4, args=(directory,), timeout=120).check()
    assert all("ok 2 -> 4 load_resharded\n" in output.stdout for output in four.ranks), four.describe()

    for world in (2, 4):
        for rank in range(world):
            saved, scattered = torch.load(path(f"w{world}-{rank}.pt")), torch.load(path(f"w{world}s-{rank}.pt"))
            assert not _same_states(saved, scattered), f"world {world} rank {rank}"

    result = subprocess.run([sys.executable, "-m", "tutel.checkpoint.gather", f"--inputs={path('w4-{rank}.pt')}",
                             "--input_size=4", f"--output={path('back.pt')}"], capture_output=True, text=True,
                            env=clean_environment(), cwd=REPO_ROOT, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"Model params have been collected to: {path('back.pt')}"
    back = torch.load(path("back.pt"))
    assert not _same_states(back, state)
    resumed = build_model(1, seed=99)
    resumed.load_state_dict(back)
    assert not mismatches(outputs(resumed, tokens()), expected)
