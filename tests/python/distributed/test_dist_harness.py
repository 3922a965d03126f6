"""The harness's rerun of commands that hit PyTorch's teardown abort, and only those."""
import sys

from dist_harness import _TEARDOWN_ABORT, run_command

# Appends a line to the file argv[1] (counting runs), then exits as argv[2] says:
# "abort-once" fails with the teardown message on the first run only, "abort" on every run,
# "error" fails with another message on every run.
SCRIPT = """
import sys
path, how = sys.argv[1], sys.argv[2]
with open(path, "a") as f:
    f.write("run\\n")
runs = len(open(path).read().splitlines())
if how == "error" or how == "abort" or runs == 1:
    sys.stderr.write({message!r} if how != "error" else "RuntimeError: something else\\n")
    sys.exit(134)
print("done")
""".format(message=_TEARDOWN_ABORT + "\n")


def _run(tmp_path, how):
    counter = tmp_path / "runs.txt"
    output = run_command([sys.executable, "-c", SCRIPT, str(counter), how], timeout=60)
    return output, len(counter.read_text().splitlines())


def test_a_teardown_abort_is_run_again(tmp_path):
    output, runs = _run(tmp_path, "abort-once")
    assert (output.returncode, runs, output.stdout.strip()) == (0, 2, "done")


def test_an_abort_in_every_run_is_reported(tmp_path):
    output, runs = _run(tmp_path, "abort")
    assert (output.returncode, runs) == (134, 2) and _TEARDOWN_ABORT in output.stderr


def test_other_failures_are_not_run_again(tmp_path):
    output, runs = _run(tmp_path, "error")
    assert (output.returncode, runs) == (134, 1) and "something else" in output.stderr
