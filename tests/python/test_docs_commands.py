"""Every command and code example in README.md, docs/ and examples/fairseq_moe/README.md is run
here, or is named with the test (or CI step) that runs it.

Commands are the lines of ```bash blocks (and lines starting with a command in plain ```
blocks); code examples are ```python blocks.  Each must match exactly one rule below: RUN (run
here, as written; a command that runs on the CPU states how long it takes, `# ... under 20 s`, and
is run with that time limit), COVERED (the named test exists and runs it, or the same thing with
smaller sizes), CI (a step of tests/run_all.sh), or OUTSIDE (needs what no test machine has: a GPU,
a fairseq checkout, the network).  A new command without a rule fails this test.
"""
import glob
import json
import os
import re
import shlex
import shutil
import subprocess
import sys

import pytest
import torch

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
PAGES = sorted(["README.md", "examples/fairseq_moe/README.md"] +
               [os.path.relpath(p, REPO) for p in glob.glob(os.path.join(REPO, "docs", "**", "*.md"), recursive=True)])
COMMAND_WORDS = ("PYTHONPATH=", "python", "python3", "bash", "pip", "mpiexec", "torchrun", "compute-sanitizer", "git", "DS_BUILD_OPS",
                 "MOE=", "FP16=")
# A command's promise, at the end of its comment: it finishes within this time on the machine README.md names.
STATED_DURATION = re.compile(r"\s#\s.*\bunder (\d+) (s|min)\s*$")
TIMED = "test_commands_finish_in_their_stated_time"

# (regex on the command, how it is exercised, detail)
RULES = [
    (r"^pip install --no-build-isolation \.$", "RUN", "test_pip_install_builds_an_importable_package"),
    (r"^pip install --no-build-isolation \.\[examples\]$", "COVERED",
     "tests/python/test_examples_classifiers.py::test_moe_mnist_without_scikit_learn_names_the_examples_extra"),
    (r"^python3 -c .import tutel\.cuda", "RUN", "test_small_commands_run"),
    (r"^python3 -m tutel\.checkpoint\.(gather|scatter) ", "RUN", "test_checkpoint_page_runs_as_written"),
    (r"^bash examples/run_demo\.sh$", "RUN", TIMED),
    (r"^python3 -m tutel\.examples\.moe_mnist --device cpu", "RUN", TIMED),
    (r"^python3 -m tutel\.examples\.moe_mnist --mnist-dir", "COVERED",
     "tests/python/test_examples_classifiers.py::test_moe_mnist_reads_a_local_mnist_copy"),
    (r"^python3 -m tutel\.examples\.moe_cifar10 ", "COVERED",
     "tests/python/test_examples_classifiers.py::test_moe_cifar10_reads_the_python_batches"),
    (r"^python3 -m tutel\.examples\.helloworld(_switch|_custom_gate_expert|_from_scratch|_amp)? .*--device cpu", "RUN",
     TIMED),
    (r"^python -m tutel\.examples\.transformers_moe ", "COVERED",
     "tests/python/integrations/test_transformers_example.py::test_transformers_moe_example_trains_and_generates"),
    (r"^python3 -m torch\.distributed\.run --nproc_per_node=2 -m tutel\.examples\.helloworld .*--device cpu", "RUN",
     TIMED),
    (r"^python -m tutel\.examples\.transformers_replace_ep$", "COVERED",
     "tests/python/distributed/test_dist_replace_example.py::test_trains_on_one_process"),
    (r"^python -m torch\.distributed\.run --nproc_per_node=2 -m tutel\.examples\.transformers_replace_ep$", "COVERED",
     "tests/python/distributed/test_dist_replace_example.py::test_trains_with_expert_parallel_under_torchrun"),
    (r"^mpiexec .*-m tutel\.launcher\.run ", "COVERED",
     "tests/python/distributed/test_dist_launcher.py::test_mpiexec_launcher_starts_torchrun_on_every_host"),
    (r"^mpiexec -n 2 python3 -m tutel\.examples", "COVERED",
     "tests/python/distributed/test_dist_launcher.py::test_openmpi_rendezvous_without_the_launcher"),
    (r"^python3 /path/to/tutel/examples/fairseq_moe/apply_patch\.py \.$", "COVERED",
     "tests/python/test_fairseq_calls.py::test_apply_patch_inserts_the_calls_once"),
    (r"^bash tests/run_all\.sh$", "CI", ".ci/run"),
    (r"^cmake -S \. -B build/cpp && cmake --build build/cpp|^ctest --test-dir build/cpp -L kernels-on-cpu", "CI",
     "tests/run_all.sh"),
    (r"^bash tests/integration/deepspeed/run\.sh$", "CI", "tests/run_all.sh"),
    (r"^DS_BUILD_OPS=0 pip install --no-deps deepspeed==|^pip install einops ", "CI",
     "tests/integration/deepspeed/run.sh"),
    (r"^git clone https://github\.com/facebookresearch/fairseq", "OUTSIDE", "a fairseq checkout (network)"),
    (r"^pip install --no-build-isolation --editable \.", "OUTSIDE", "installs the fairseq checkout"),
    (r"(MOE|FP16)=.* bash /path/to/tutel/examples/fairseq_moe/run_fairseq\.sh", "OUTSIDE",
     "fairseq, WikiText-103 and 8 GPUs (the script's syntax is checked here)"),
    (r"^compute-sanitizer ", "OUTSIDE", "a GPU (tests/python/test_cuda_ops.py runs without the sanitizer)"),
    (r"^python benchmarks/cuda_kernels\.py", "OUTSIDE", "a GPU; a benchmark, not a test"),
    (r"^python benchmarks/layer\.py && .* && python benchmarks/report\.py$", "COVERED",
     "tests/python/test_benchmarks_smoke.py::test_report_rebuilds_the_page_from_smoke_results"),
    (r"^PYTHONPATH=\. python -m torch\.distributed\.run .*benchmarks/dist_alltoall\.py$", "COVERED",
     "tests/python/test_benchmarks_smoke.py::test_dist_alltoall_smoke_run_on_two_processes"),
]
PYTHON_RULES = [
    ("from tutel import moe\n\nlayer = moe.moe_layer(", "RUN", "test_python_examples_run"),
    ("checkpoint.load_resharded(model,", "RUN", "test_checkpoint_page_runs_as_written"),
    ("import tutel.integrations.transformers", "COVERED",
     "tests/python/integrations/test_transformers_docs.py::test_the_documented_code_runs"),
    ("assert replace_moe_blocks(model) == 2", "COVERED",
     "tests/python/integrations/test_replace_moe_blocks.py::test_documented_example_runs"),
    ("from deepspeed.moe.layer import MoE", "COVERED",
     "tests/integration/deepspeed/test_deepspeed_doc_example.py::test_documented_example_runs"),
    ("routed_quantized_experts(x, expert_ids", "COVERED",
     "tests/python/integrations/test_quantized_docs.py::test_the_routed_call_over_each_format_runs"),
    ("use_mxfp4_experts(model, tensors)", "COVERED",
     "tests/python/integrations/test_quantized_docs.py::test_a_gpt_oss_model_takes_its_checkpoints_mxfp4_experts"),
    ("tutel_hf.enable(model, fp8_activations", "COVERED",
     "tests/python/integrations/test_quantized_docs.py::test_a_model_with_fp8_experts_is_enabled_both_ways"),
    ('layer.eval().quantize_experts("nvfp4")', "COVERED",
     "tests/python/integrations/test_quantized_docs.py::test_a_layer_quantizes_its_experts_in_place"),
]


def _blocks(page):
    with open(os.path.join(REPO, page)) as handle:
        return re.findall(r"^```(\w*)\n(.*?)^```", handle.read(), flags=re.S | re.M)


def _commands(language, body):
    """(command, stated seconds or None) for each command line of a block."""
    joined = re.sub(r"\\\n\s*", " ", body)
    for line in joined.splitlines():
        first = line.split()[0] if line.split() else ""
        if language in ("bash", "sh") or (language == "" and first.startswith(COMMAND_WORDS)):
            words = shlex.split(line, comments=True)
            if words:
                yield " ".join(shlex.quote(w) if " " in w else w for w in words), _stated_seconds(line)


def _stated_seconds(line):
    """The time a command's comment promises it finishes in (`# ...: under 20 s` or `under 5 min`)."""
    match = STATED_DURATION.search(line)
    return None if match is None else int(match.group(1)) * (60 if match.group(2) == "min" else 1)


def timed_commands():
    """(page, command, stated seconds or None) for every command the pages print."""
    return [(page, command, seconds) for page in PAGES for language, body in _blocks(page)
            for command, seconds in _commands(language, body)]


def all_commands():
    return [(page, command) for page, command, _ in timed_commands()]


def all_python():
    return [(page, body) for page in PAGES for language, body in _blocks(page) if language == "python"]


def _rule(text, rules, search):
    matches = [rule for rule in rules if (re.search(rule[0], text) if search else rule[0] in text)]
    assert len(matches) == 1, f"{text!r} matches {len(matches)} rules (needs exactly one): add or fix a rule"
    return matches[0]


def _check_covered(detail):
    path, name = detail.split("::")
    with open(os.path.join(REPO, path)) as handle:
        assert re.search(rf"^def {name}\(", handle.read(), re.M), f"{detail} does not exist"


def test_every_command_and_example_has_a_rule():
    commands, examples = all_commands(), all_python()
    assert len(commands) > 20 and len(examples) >= 4
    for page, command in commands:
        _, kind, detail = _rule(command, RULES, search=True)
        if kind == "COVERED":
            _check_covered(detail)
        elif kind == "RUN":
            assert detail in globals(), detail
        elif kind == "CI":
            assert os.path.exists(os.path.join(REPO, detail))
    for page, body in examples:
        _, kind, detail = _rule(body, PYTHON_RULES, search=False)
        if kind == "COVERED":
            _check_covered(detail)
    with open(os.path.join(REPO, "tests", "run_all.sh")) as handle:
        ci = handle.read()
    assert "tests/integration/deepspeed/run.sh" in ci and "pytest" in ci


def test_shell_scripts_named_in_the_docs_parse():
    for script in ("examples/run_demo.sh", "examples/fairseq_moe/run_fairseq.sh", "tests/run_all.sh"):
        result = subprocess.run(["bash", "-n", os.path.join(REPO, script)], capture_output=True, text=True)
        assert result.returncode == 0, result.stderr


def test_api_reference_is_generated_from_the_current_docstrings():
    result = subprocess.run([sys.executable, os.path.join(REPO, "docs", "generate_api.py"), "--check"],
                            capture_output=True, text=True, timeout=120, cwd=REPO)
    assert result.returncode == 0, result.stderr


def test_api_reference_holds_only_tutels_own_docstrings():
    """An undocumented method or constructor must not show what a PyTorch or Python base class says
    (nn.Module.__init__'s "Initialize internal Module state, ..."): that describes the base, not tutel.
    In a fresh interpreter: other tests (DeepSpeed's zero.Init, transformers' loaders) may patch
    nn.Module's methods for a while, and the generator runs in one of its own."""
    script = (
        "import importlib.util, inspect, json, sys, torch\n"
        "spec = importlib.util.spec_from_file_location('generate_api', sys.argv[1])\n"
        "generator = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(generator)\n"
        "text = generator.render()\n"
        "bases = (torch.nn.Module, torch.autograd.Function, Exception, object)\n"
        "inherited = {inspect.getdoc(member) for base in bases for member in [base, *vars(base).values()]\n"
        "             if callable(member) and inspect.getdoc(member)}\n"
        "print(json.dumps({'inherited': sorted(inherited), 'text': text}))\n")
    result = subprocess.run([sys.executable, "-c", script, os.path.join(REPO, "docs", "generate_api.py")],
                            capture_output=True, text=True, timeout=120, cwd=REPO)
    assert result.returncode == 0, result.stderr
    found = json.loads(result.stdout)
    inherited, text = found["inherited"], found["text"]
    assert "Initialize internal Module state" in "".join(inherited)  # the test looks where the text comes from
    repeated = sorted(doc.splitlines()[0] for doc in inherited if doc in text)
    assert not repeated, f"docs/api.md repeats docstrings of PyTorch or Python base classes: {repeated}"


def test_small_commands_run():
    ran = 0
    for page, command in all_commands():
        if _rule(command, RULES, search=True)[2] == "test_small_commands_run":
            ran += 1
            result = subprocess.run(command, shell=True, capture_output=True, text=True, cwd=REPO, timeout=120,
                                    env=dict(os.environ, PYTHONPATH=REPO))
            assert result.returncode == 0, f"{page}: {command}\n{result.stderr}"
    assert ran >= 1


def test_python_examples_run():
    ran = 0
    for page, body in all_python():
        if _rule(body, PYTHON_RULES, search=False)[2] == "test_python_examples_run":
            namespace = {}
            exec(compile(body, page, "exec"), namespace)
            assert namespace["y"].shape == namespace["x"].shape
            ran += 1
    assert ran >= 2


def test_checkpoint_page_runs_as_written(tmp_path, monkeypatch):
    from tutel import checkpoint, moe
    monkeypatch.chdir(tmp_path)
    make = lambda: moe.moe_layer(gate_type={"type": "top", "k": 2}, model_dim=6,  # noqa: E731
                                 experts={"type": "ffn", "num_experts_per_device": 8, "hidden_size_per_expert": 4})
    original = make()
    os.mkdir("ckpt")
    for rank, part in enumerate(checkpoint.scatter_state_dict(original.state_dict(), 8)):  # 8 processes' files
        torch.save(part, f"ckpt/model-{rank}-of-8.pt")
    commands = [c for page, c in all_commands() if page == "docs/checkpoints.md"]
    assert [c.split()[2] for c in commands] == ["tutel.checkpoint.gather", "tutel.checkpoint.scatter"]
    for command in commands:
        result = subprocess.run(command, shell=True, capture_output=True, text=True, timeout=120,
                                env=dict(os.environ, PYTHONPATH=REPO))
        assert result.returncode == 0, result.stderr
        assert "Model params have been" in result.stdout
    assert len(glob.glob("ckpt/model-*-of-16.pt")) == 16
    merged = make()
    merged.load_state_dict(torch.load("ckpt/model-all.pt"))
    (code,) = [body for page, body in all_python() if page == "docs/checkpoints.md"]
    model = make()
    exec(compile(code, "docs/checkpoints.md", "exec"), {"model": model})
    for key, value in original.state_dict().items():
        assert torch.equal(model.state_dict()[key], value) and torch.equal(merged.state_dict()[key], value), key


def test_pip_install_builds_an_importable_package(tmp_path):
    """`pip install --no-build-isolation .` with CUDA_HOME at a toolkit that has an nvcc and no
    headers (what a bare nvcc on PATH makes PyTorch guess): the install succeeds and its extension
    is CPU-only, with a CUDA build of PyTorch as with a CPU one, instead of failing in the compiler."""
    pytest.importorskip("pip")
    target, cuda_home = tmp_path / "site", tmp_path / "cuda"
    (cuda_home / "bin").mkdir(parents=True)
    (cuda_home / "bin" / "nvcc").write_text("#!/bin/sh\nexit 1\n")
    (cuda_home / "bin" / "nvcc").chmod(0o755)
    install = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-build-isolation", "--no-deps",
                              "--target", str(target), "."], capture_output=True, text=True, cwd=REPO, timeout=600,
                             env=dict(os.environ, CUDA_HOME=str(cuda_home), TUTEL_WITH_CUDA=""))
    assert install.returncode == 0, install.stderr
    # The decode kernel's measured lines are package data: read from the installed tree.
    check = subprocess.run([sys.executable, "-c", "import tutel, tutel.moe, tutel.checkpoint, tutel.cuda; "
                            "print(tutel.__file__); print(tutel.cuda.is_built()); "
                            "from tutel.ops import decode_lines; decode_lines.read_lines()"],
                           capture_output=True, text=True, cwd=tmp_path, timeout=120,
                           env=dict(os.environ, PYTHONPATH=str(target)))
    assert check.returncode == 0, check.stderr
    location, cuda_built = check.stdout.split("\n")[:2]
    assert location.startswith(str(target)) and cuda_built == "False"


def test_editable_install_imports_from_the_source_tree(tmp_path):
    """`pip install -e .` (README's install notes), from a copy of the checkout's files so that the
    build cannot touch the extension this test process has loaded.  Where the checkout's build went
    through ccache (tests/setup_build.sh), the copy's compiles come from its cache: pip's temporary
    build directory is put at the depth of the checkout's (source/build/tmp*), and the paths inside
    the copy are made relative to it (CCACHE_BASEDIR), so the compiler commands hash alike."""
    pytest.importorskip("pip")
    source, prefix = tmp_path / "source", tmp_path / "prefix"
    _copy_checkout(source)
    (source / "build").mkdir(exist_ok=True)
    env = {**os.environ, "CCACHE_BASEDIR": str(source), "TMPDIR": str(source / "build")}
    install = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-build-isolation", "--no-deps",
                              "--prefix", str(prefix), "-e", "."], capture_output=True, text=True, cwd=source,
                             timeout=900, env=env)
    assert install.returncode == 0, install.stderr[-4000:]
    (site_packages,) = glob.glob(str(prefix / "lib" / "python*" / "site-packages"))
    check = subprocess.run([sys.executable, "-c", "import site, sys; site.addsitedir(sys.argv[1]); import torch, tutel; "
                            "from tutel import moe; print(tutel.__file__); "
                            "print(moe.fast_cumsum_sub_one(torch.tensor([[1, 0], [1, 1], [0, 1]])).tolist())",
                            site_packages], capture_output=True, text=True, cwd=tmp_path, timeout=120,
                           env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})  # CI points it at REPO
    assert check.returncode == 0, check.stderr
    location, cumsum = check.stdout.split("\n")[:2]
    assert location.startswith(str(source)) and cumsum == "[[0, -1], [1, 0], [1, 1]]"


def _copy_checkout(destination, names=()):
    """Copies the checkout's files (tracked, and untracked ones git does not ignore) and the given
    ignored ones (paths relative to the checkout; glob patterns) to `destination`."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            capture_output=True, text=True, cwd=REPO, check=True).stdout.split("\0")
    extra = [os.path.relpath(p, REPO) for pattern in names for p in glob.glob(os.path.join(REPO, pattern))]
    for name in filter(None, listed + extra):
        if os.path.isfile(os.path.join(REPO, name)):
            os.makedirs(os.path.join(destination, os.path.dirname(name)), exist_ok=True)
            shutil.copy2(os.path.join(REPO, name), os.path.join(destination, name))


def _timed_runs():
    """The commands test_commands_finish_in_their_stated_time runs, one test each."""
    return [pytest.param(page, command, seconds, id=f"{page}: {command}") for page, command, seconds in timed_commands()
            if any(re.search(pattern, command) and detail == TIMED for pattern, _, detail in RULES)]


@pytest.mark.parametrize("page, command, seconds", _timed_runs())
def test_commands_finish_in_their_stated_time(page, command, seconds, tmp_path):
    """The command runs exactly as printed and finishes within the time its page states for it (on a
    machine like the one README.md names).  Scripts run in a copy of the checkout with its built
    extension, so the demo's set-up finds what a finished set-up leaves; other commands run where a
    user with tutel installed might, in an empty directory."""
    assert seconds, f"{page}: {command!r} states no duration: end its comment with 'under N s' (or 'N min')"
    env = {name: value for name, value in os.environ.items() if name != "PYTHONPATH"}
    if command.startswith("bash "):
        cwd = tmp_path / "checkout"
        _copy_checkout(cwd, ["tutel/_C*.so", "build/tutel_extension.fingerprint"])
    else:
        cwd = tmp_path / "run"
        cwd.mkdir()
        env["PYTHONPATH"] = REPO
    process = subprocess.Popen(command, shell=True, cwd=cwd, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=seconds)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, 9)
        output, _ = process.communicate()
        pytest.fail(f"{page}: {command!r} did not finish within the {seconds} s its page states\n{output[-3000:]}")
    assert process.returncode == 0, f"{page}: {command}\n{output[-3000:]}"
