"""tutel built from two source trees, timed on the same cases: the check that a change (a refactor,
a new path chooser) slows nothing down, before against after.

Two builds of the extension cannot share a process (both register the tutel operators), so the
trees take turns, one process per tree and round, in the order before, after, after, before, ...
(a drift of the machine's speed over the run then falls on both alike).  Every process builds the
same seeded transformers blocks (benchmarks/_hf_blocks.py) and times, interleaved call by call,
each case's candidates on the same inputs, every call after the same cache reset (cold weights, as
in decoding):

    tutel      the transformers experts module under experts_implementation="tutel"
    moe_layer  tutel.moe.moe_layer holding the same weights (dropless), its own router included

A case's time for a tree is the median over that tree's rounds; "spread" is (slowest - fastest) /
median of those rounds, the noise to read a ratio against.  after/before > 1 is a slowdown.

    python benchmarks/compare_builds.py --before /path/to/old/checkout --after . \\
        [--tokens 1,16,2048] [--families qwen3_moe,mixtral,deepseek_v3,gpt_oss] [--dtypes float32,bfloat16]

Each tree must hold its extension built in place (python3 setup.py build_ext --inplace).  Writes
benchmarks/results/compare_builds.json (--out), which benchmarks/report.py shows in docs/performance.md.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
from typing import Dict, List, Optional, Sequence

HERE = os.path.dirname(os.path.abspath(__file__))


def _worker(tree: str, families: List[str], dtypes: List[str], tokens: List[int], reps: int,
            smoke: bool) -> Dict[str, dict]:
    """Times every case with the tutel of `tree`; returns {case: {candidate: median seconds}}."""
    # tutel from `tree`, the benchmark helpers from this directory
    sys.path[:] = [tree, HERE] + [p for p in sys.path if os.path.abspath(p or ".") not in
                                  (os.path.abspath(tree), HERE, os.path.dirname(HERE))]
    import torch
    import tutel
    assert os.path.dirname(os.path.abspath(tutel.__file__)) == os.path.join(os.path.abspath(tree), "tutel"), \
        f"tutel imported from {tutel.__file__}, not from {tree}"
    from _common import interleaved_medians
    from _hf_blocks import build_block, case_inputs, experts_call, moe_layer_like, tutel_backend_name
    from _limits import cache_reset

    torch.set_num_threads(2)
    ours = tutel_backend_name()
    reset = cache_reset(smoke)
    medians: Dict[str, dict] = {}
    for family in families:
        for dtype_name in dtypes:
            block = build_block(family, getattr(torch, dtype_name), smoke=smoke)
            layer = moe_layer_like(block)
            for count in tokens:
                x, indices, weights, grad = case_inputs(block, count, False)
                candidates = {"tutel": experts_call(block, ours, x, indices, weights, False, grad)}
                if layer is not None:
                    def layer_call(layer=layer, x=x):
                        with torch.no_grad():
                            layer(x, capacity_factor=0.0, megablocks_size=1)
                    candidates["moe_layer"] = layer_call
                times = interleaved_medians(candidates, reps, warmup=1, before_each=reset)
                medians[f"{family} {dtype_name} T={count}"] = dict(times)
    return medians


def _run_worker(tree: str, args: argparse.Namespace) -> Dict[str, dict]:
    command = [sys.executable, os.path.abspath(__file__), "--worker", tree, "--families", args.families,
               "--dtypes", args.dtypes, "--tokens", args.tokens, "--reps", str(args.reps)]
    command += ["--smoke"] if args.smoke else []
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    result = subprocess.run(command, capture_output=True, text=True, env=env)
    if result.returncode != 0:
        raise RuntimeError(f"the worker for {tree} failed:\n{result.stderr}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def _summary(rounds: Dict[str, List[Dict[str, dict]]]) -> List[Dict[str, object]]:
    rows = []
    for case in rounds["before"][0]:
        for candidate in rounds["before"][0][case]:
            row: Dict[str, object] = {"case": case, "candidate": candidate}
            for tree in ("before", "after"):
                samples = [r[case][candidate] for r in rounds[tree]]
                median = statistics.median(samples)
                row[f"{tree}_ms"] = median * 1e3
                row[f"{tree}_spread"] = (max(samples) - min(samples)) / median
            row["after/before"] = row["after_ms"] / row["before_ms"]
            rows.append(row)
    return rows


def main(argv: Optional[Sequence[str]] = None) -> List[Dict[str, object]]:
    """Runs the comparison (or, with --worker, one tree's process); returns the summary rows."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", help="source tree of the old build")
    parser.add_argument("--after", default=os.path.dirname(HERE), help="source tree of the new build")
    parser.add_argument("--families", default="qwen3_moe,mixtral,deepseek_v3,gpt_oss")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--tokens", default="1,16,2048")
    parser.add_argument("--rounds", type=int, default=4, help="processes per tree (default 4)")
    parser.add_argument("--reps", type=int, default=5, help="timed calls per candidate in a process")
    parser.add_argument("--out", default=os.path.join(HERE, "results"), help="directory for compare_builds.json")
    parser.add_argument("--smoke", action="store_true", help="tiny blocks (a check that the script runs)")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(_worker(args.worker, args.families.split(","), args.dtypes.split(","),
                                 [int(t) for t in args.tokens.split(",")], args.reps, args.smoke)))
        return []
    if not args.before:
        parser.error("--before is required")
    trees = {"before": os.path.abspath(args.before), "after": os.path.abspath(args.after)}
    rounds: Dict[str, List[Dict[str, dict]]] = {"before": [], "after": []}
    for number in range(args.rounds):
        order = ("before", "after") if number % 2 == 0 else ("after", "before")
        for tree in order:
            rounds[tree].append(_run_worker(trees[tree], args))
            print(f"round {number + 1}/{args.rounds}: {tree} done", file=sys.stderr)
    rows = _summary(rounds)
    revisions = {tree: subprocess.run(["git", "-C", path, "rev-parse", "--short", "HEAD"], capture_output=True,
                                      text=True).stdout.strip() for tree, path in trees.items()}
    sys.path.insert(0, HERE)
    import torch
    from _common import write_result
    torch.set_num_threads(2)  # what the workers ran with, for the machine record
    write_result(args.out, "compare_builds", {"revisions": revisions, "rounds": args.rounds, "reps": args.reps,
                                              "rows": rows, "command": " ".join(["compare_builds.py", *(argv or sys.argv[1:])])},
                 smoke=args.smoke)
    print(f"before {revisions['before']}, after {revisions['after']}; {args.rounds} rounds of {args.reps} calls")
    print(f"{'case':<28} {'candidate':<10} {'before ms':>10} {'after ms':>10} {'after/before':>13} {'spread':>14}")
    for row in rows:
        print(f"{row['case']:<28} {row['candidate']:<10} {row['before_ms']:>10.3f} {row['after_ms']:>10.3f} "
              f"{row['after/before']:>13.3f} {row['before_spread']:>6.2f}/{row['after_spread']:<6.2f}")
    return rows


if __name__ == "__main__":
    main()
