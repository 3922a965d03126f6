"""benchmarks/compare_builds.py: the builds take turns (before, after, after, before), a case's time
for a build is the median of its processes, and a worker process times the candidates with the
tutel of the tree it is given (this checkout, at tiny sizes).  No timing is checked."""
import importlib.util
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "benchmarks", "compare_builds.py")


def _load(name, path):
    sys.path.insert(0, os.path.dirname(path))
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_builds_take_turns_and_each_time_is_the_median_of_its_processes(tmp_path, monkeypatch):
    compare = _load("tutel_benchmark_compare_builds", SCRIPT)
    calls = []
    ms = {"/b": [3.0, 1.0, 2.0], "/a": [4.0, 6.0, 5.0]}  # per process, in the order they run

    def fake_worker(tree, args):
        calls.append(tree)
        return {"case": {"tutel": ms[tree][sum(t == tree for t in calls) - 1] / 1e3}}
    monkeypatch.setattr(compare, "_run_worker", fake_worker)
    rows = compare.main(["--before", "/b", "--after", "/a", "--rounds", "3", "--out", str(tmp_path)])
    assert calls == ["/b", "/a", "/a", "/b", "/b", "/a"]
    (row,) = rows
    assert row["before_ms"] == 2.0 and row["after_ms"] == 5.0 and row["after/before"] == 2.5
    assert row["before_spread"] == 1.0 and row["after_spread"] == 2.0 / 5.0
    with open(tmp_path / "compare_builds.json") as handle:
        written = json.load(handle)
    assert written["rows"] == rows and written["rounds"] == 3 and set(written["revisions"]) == {"before", "after"}


def test_a_worker_times_both_candidates_with_the_tutel_of_its_tree():
    result = subprocess.run([sys.executable, SCRIPT, "--worker", REPO, "--smoke", "--families", "mixtral",
                             "--dtypes", "float32", "--tokens", "1,3", "--reps", "1"],
                            capture_output=True, text=True, timeout=300, cwd="/")
    assert result.returncode == 0, result.stderr[-4000:]
    medians = json.loads(result.stdout.strip().splitlines()[-1])
    assert set(medians) == {"mixtral float32 T=1", "mixtral float32 T=3"}
    assert all(set(times) == {"tutel", "moe_layer"} and min(times.values()) > 0 for times in medians.values())


def test_the_report_shows_the_run():
    report = _load("tutel_benchmark_report", os.path.join(REPO, "benchmarks", "report.py"))
    row = {"case": "mixtral float32 T=1", "candidate": "tutel", "before_ms": 2.0, "after_ms": 1.5,
           "after/before": 0.75, "before_spread": 0.1, "after_spread": 0.2}
    text = report.compare_builds_section({"machine": {"cpu": "a CPU", "logical_cpus": 2, "torch_threads": 2,
                                                      "torch": "2.x"}, "revisions": {"before": "aaa", "after": "bbb"},
                                          "rounds": 4, "reps": 5, "rows": [row], "finished": "today"})
    assert "at aaa (before) and at bbb (after)" in text and "| mixtral float32 T=1 | tutel | 2 | 1.5 | 0.75 |" in text
