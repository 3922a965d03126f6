"""Checkpoint resharding across real processes (see test_dist_checkpoint.py for the sequence).

Every rank builds the model for its world size, loads a checkpoint written at another world
size and checks that each layer's output on the shared tokens is bit-identical to the
one-process model's."""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/python

from checkpoint_models import build_model, mismatches, outputs, tokens  # noqa: E402
from dist_checks import expect_error, rank  # noqa: E402
from dist_harness import init_gloo  # noqa: E402
from tutel import checkpoint  # noqa: E402


def _check_outputs(model, directory: str, what: str) -> None:
    expected = torch.load(os.path.join(directory, "expected.pt"))
    wrong = mismatches(outputs(model, tokens()), expected)
    assert not wrong, f"{what} (rank {rank()}): outputs differ from the one-process model: {wrong}"
    print(f"ok {what}", flush=True)


def two_ranks(directory: str) -> None:
    """1 -> 2 (gathered file through load_state_dict, and through load_resharded), 4 -> 2."""
    init_gloo()
    path = lambda name: os.path.join(directory, name)  # noqa: E731
    model = build_model(2, seed=10 + rank())
    model.load_state_dict(torch.load(path("global.pt")))
    _check_outputs(model, directory, "1 -> 2 load_state_dict(gathered)")
    torch.save(model.state_dict(), path(f"w2-{rank()}.pt"))

    model = build_model(2, seed=20 + rank())
    checkpoint.load_resharded(model, path("global.pt"), saved_world_size=1)
    _check_outputs(model, directory, "1 -> 2 load_resharded")

    model = build_model(2, seed=30 + rank())
    checkpoint.load_resharded(model, path("w4s-{rank}.pt"), saved_world_size=4)
    _check_outputs(model, directory, "4 -> 2 load_resharded")

    # another rank's file, and a file of another world size, are refused with the reason
    other = torch.load(path(f"w2s-{1 - rank()}.pt"))
    expect_error(ValueError, ["holds the experts of rank", f"this process is rank {rank()}"],
                 model.load_state_dict, other)
    expect_error(ValueError, ["saved by rank", "of 4 processes", "load_resharded"],
                 model.load_state_dict, torch.load(path(f"w4s-{rank()}.pt")))
    print("ok refusals", flush=True)


def four_ranks(directory: str) -> None:
    """2 -> 4 from the files the two processes saved."""
    init_gloo()
    model = build_model(4, seed=40 + rank())
    checkpoint.load_resharded(model, os.path.join(directory, "w2-{rank}.pt"), saved_world_size=2)
    _check_outputs(model, directory, "2 -> 4 load_resharded")
    torch.save(model.state_dict(), os.path.join(directory, f"w4-{rank()}.pt"))
