"""benchmarks/run_on_gpu.sh: its step selection, and the two halves its header prescribes for a machine
whose commands may run 600 s each (the steps' time limits must fit each half)."""
import os
import re
import subprocess

import pytest

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
SCRIPT = os.path.join(REPO, "benchmarks", "run_on_gpu.sh")
ONE_COMMAND_SECONDS = 600


def _script() -> str:
    with open(SCRIPT) as handle:
        return handle.read()


def _run(steps: str, tmp_path) -> subprocess.CompletedProcess:
    env = dict(os.environ, TUTEL_GPU_STEPS=steps)
    return subprocess.run(["bash", SCRIPT, str(tmp_path / "out")], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)


def _step_limits() -> dict:
    """{step: its limit in seconds under the default environment}, read off the `step NAME LIMIT` calls."""
    limits = {}
    for name, limit in re.findall(r"^\s*(?:wanted \w+ && )?(?:TAIL_LINES=\d+ )?step (\w+) (\S+)", _script(), re.M):
        default = re.fullmatch(r'"?\$\{\w+:-(\d+)\}"?', limit)
        limits[name] = int(default.group(1) if default else limit)
    return limits


def test_an_unknown_step_is_refused_with_the_list_of_steps(tmp_path):
    result = _run("build benchmark", tmp_path)
    assert result.returncode == 2
    assert "unknown step 'benchmark'" in result.stdout
    assert "build gpu_tests helloworld cuda_kernels quantized_experts decode_line transformers_moe" in result.stdout
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())  # refused before any step


def test_the_prescribed_halves_cover_every_step_once_within_one_command():
    halves = re.findall(r'TUTEL_GPU_STEPS="([\w ]+)" bash benchmarks/run_on_gpu.sh', _script())
    limits = _step_limits()
    assert set(limits) == {"build", "gpu_tests", "helloworld", "cuda_kernels", "quantized_experts", "decode_line",
                           "transformers_moe"}
    assert len(halves) == 2
    named = [name for half in halves for name in half.split()]
    assert sorted(named) == sorted(limits), "each step in exactly one half"
    for half in halves:
        assert sum(limits[name] for name in half.split()) <= ONE_COMMAND_SECONDS, half
    assert "build" in halves[0].split(), "the first half builds what the second one uses"


def test_without_the_build_step_a_cpu_only_extension_is_refused(tmp_path):
    import tutel.cuda
    if tutel.cuda.is_built():
        pytest.skip("this build has the CUDA operators: the script would run the step")
    result = _run("helloworld", tmp_path)
    assert result.returncode == 1
    assert "no build step" in result.stdout and "no CUDA operators" in result.stdout
    assert not (tmp_path / "out" / "helloworld.log").exists()


def test_the_gpu_tests_are_every_test_file_with_tests_that_need_a_cuda_device():
    """A test file whose tests skip without a CUDA device runs them in the script's gpu_tests step."""
    listed = set(re.findall(r"tests/python/[\w/]+\.py", _script()[_script().index("gpu_tests=("):]))
    tests_dir = os.path.join(REPO, "tests", "python")
    needing = set()
    for directory, _, names in os.walk(tests_dir):
        for name in names:
            if name.startswith("test_") and name.endswith(".py") and name != os.path.basename(__file__):
                with open(os.path.join(directory, name)) as handle:
                    if re.search(r"reason=\"needs a CUDA device\"|cuda_available\b", handle.read()):
                        needing.add(os.path.relpath(os.path.join(directory, name), REPO))
    assert needing and needing <= listed, sorted(needing - listed)


def test_the_gpu_tests_include_the_quantized_experts_cuda_launch_counts():
    """The launch counts of the quantized experts trace fake CUDA tensors (they run anywhere), and run
    against the CUDA build's own operators in the gpu_tests step too."""
    listed = set(re.findall(r"tests/python/[\w/]+\.py", _script()[_script().index("gpu_tests=("):]))
    for path in ("tests/python/test_quantized_cuda_launches.py",
                 "tests/python/test_quantized_grouped_linear_launches.py",
                 "tests/python/integrations/test_quantized_cuda_launches_transformers.py"):
        assert path in listed and os.path.exists(os.path.join(REPO, path)), path


def test_the_quantized_experts_step_runs_the_cuda_benchmark_offline_into_the_output_directory():
    line = next(line for line in _script().splitlines() if "step quantized_experts" in line)
    following = _script()[_script().index(line):].split("\n", 2)[:2]
    command = " ".join(following)
    assert "HF_HUB_OFFLINE=1" in command and "benchmarks/quantized_experts.py --device cuda" in command
    assert '--out "$out"' in command
