"""python -m tutel.examples.transformers_moe, briefly: the loss falls, the plot is written and
text comes out."""
import os
import re
import subprocess
import sys

import pytest

from transformers_test_setup import one_intra_op_thread  # noqa: F401  (autouse fixture)

pytest.importorskip("transformers")

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
SUMMARY = re.compile(r"loss: first 10 steps ([\d.]+), last 10 steps ([\d.]+)")


@pytest.mark.slow
def test_transformers_moe_example_trains_and_generates(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "tutel.examples.transformers_moe", "--steps", "30", "--log-every", "10",
         "--batch-size", "8", "--seq-len", "32", "--lr", "1e-2", "--generate", "24", "--output-dir", str(tmp_path),
         "--no-progress"],
        capture_output=True, text=True, cwd=REPO, timeout=600,
        env=dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1"))  # one thread: see transformers_test_setup
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "experts_implementation='tutel'" in out, out
    assert len(re.findall(r"^step \d+/30  loss ", out, re.M)) == 3, out
    first, last = (float(v) for v in SUMMARY.search(out).groups())
    assert last < first - 0.25, out  # from about 3.3 (nats per character) to about 2.8
    with open(tmp_path / "transformers_moe_loss.png", "rb") as handle:
        assert handle.read(8) == b"\x89PNG\r\n\x1a\n"
    generated = out.split("generated:\n", 1)[1]
    assert generated.startswith("The river ") and len(generated.rstrip("\n")) >= len("The river ") + 20, out
