"""Host cost per forward: the Python calls inside the library's own files and the warm eager time of
one call, at sizes where the kernels cost next to nothing.

Cases (inference: eval mode, torch.no_grad):

    experts            a transformers Qwen3-MoE experts module (256 features, 128 per expert, 32
                       experts, top-8, bfloat16) under the experts implementations "tutel",
                       "eager", "batched_mm" and "grouped_mm", on the same routing
    moe_layer ffn      tutel.moe.moe_layer, gate {'type': 'top', 'k': 2}, 'ffn' experts (Tutel's
                       style), 256 features, 128 per expert, 32 experts, bfloat16
    moe_layer llama    the same with 'llama_ffn' (SwiGLU) experts and top-8
    tiny eval          moe_layer ffn, 16 features, 16 per expert, 4 experts, top-2, float32, 1 token

each at 1 and 64 tokens (tiny: 1), on the CPU and on fake CUDA tensors (what the CUDA path runs
on the host, traced here without a GPU: torch._subclasses.fake_tensor.FakeTensorMode; tiny: CPU
only).  Every moe_layer case also runs Microsoft Tutel 0.3.3's moe_layer (commit 82af7aa) built
beside, given with --tutel-reference: a directory holding its `tutel` package and its compiled
`tutel_custom_kernel` module, e.g. made with

    git -C /path/to/Tutel archive --prefix=src/ 82af7aa | tar -x -C DIR
    NO_CUDA=1 pip install --no-build-isolation --no-deps --target DIR/tutel-0.3.3 DIR/src

That package is loaded under another name (tutel_reference: its imports are relative), so both
run in one process, interleaved.  Its 'ffn' experts get activation_fn=relu (its default activation
raises a NameError); ours keep their default, a ReLU.

Columns: `path` is the path tutel's moe_layer takes (layer.choose_path; with the gate's default
capacity factor: the static grouped path on CUDA, the padded one on the CPU).  `package calls`
counts the calls of Python functions defined in the candidate's package (tutel's for tutel and for
transformers' backends, Tutel 0.3.3's for it; primitive and recursive: tests/python/host_calls.py),
after three warm-up calls; it is counted twice and `steady` says whether both counts agreed.  On
fake CUDA, `shape fns` is how many of them were tutel's operators' shape functions, which run only on
fake tensors (a GPU runs a kernel instead).  `python calls` and `C calls` are all the Python and C
function calls of the call (CPU only: on fake tensors PyTorch's fake-tensor machinery, Python
itself, would dominate them).  `us/call` (CPU only; on fake tensors times mean nothing) is the median
over interleaved rounds, every candidate of a case once per round in shuffled order, of the time
per call of a batch of calls.  Tutel 0.3.3 cannot be traced on fake CUDA: its first call compiles
its kernels through the CUDA driver.

    python benchmarks/host_cost.py --tutel-reference DIR/tutel-0.3.3 [--breakdown 20]
    python benchmarks/host_cost.py --quick          # a check that it runs (few repetitions)

The JSON goes to benchmarks/results/host_cost.json (--out), from which benchmarks/report.py writes
the table into docs/performance.md.
"""
import argparse
import contextlib
import importlib
import importlib.util
import os
import sys
import time
import traceback
from typing import Callable, Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)
# The counting harness lives with the tests, which hold the counts; nothing there imports from
# benchmarks/, so appending its directory makes no cycle (appended: its modules shadow nothing here).
TESTS_DIR = os.path.join(os.path.dirname(HERE), "tests", "python")
if TESTS_DIR not in sys.path:
    sys.path.append(TESTS_DIR)

import torch  # noqa: E402

from _common import RESULTS_DIR, format_table, interleaved_medians, write_result  # noqa: E402
from host_calls import (CallCount, count_calls_under, fake_cuda, shape_function_keys,  # noqa: E402
                        tutel_package_dir)

ROOT = os.path.dirname(HERE)
REFERENCE = "Tutel 0.3.3"
REFERENCE_MODULE = "tutel_reference"
TRANSFORMERS_BACKENDS = ("eager", "batched_mm", "grouped_mm")
TOKENS, QUICK_TOKENS = (1, 64), (1, 4)
WARMUP_CALLS = 3
SAMPLE_SECONDS = 2e-3  # a timed sample is a batch of calls lasting about this long (timer resolution)
EXPERTS_CALLS_TARGET, LAYER_CALLS_TARGET, TINY_TIME_TARGET = 30, 60, 0.6

Calls = Dict[str, Callable[[], object]]


class Reference(NamedTuple):
    """Microsoft Tutel's moe module loaded beside tutel, or why not."""

    moe: Optional[object]
    package_dir: Optional[str]
    reason: str  # why it is not available ("" when it is)


class Case(NamedTuple):
    """One section of the table: `make(device, tokens)` returns ({candidate: call}, {candidate: why
    it is missing}); for "fake cuda" it runs inside fake_cuda()."""

    name: str
    devices: Tuple[str, ...]
    tokens: Tuple[int, ...]
    make: Callable[[str, int], Tuple[Calls, Dict[str, str]]]


# ------------------------------------------------------------------------------------------- loading

def load_reference(path: Optional[str]) -> Reference:
    """Tutel 0.3.3's `tutel.moe` from `path` (a directory holding its `tutel` package and its compiled
    tutel_custom_kernel), imported as tutel_reference.moe beside this process's tutel."""
    if not path:
        return Reference(None, None, "not available (no --tutel-reference)")
    package = os.path.join(os.path.abspath(path), "tutel")
    if not os.path.isfile(os.path.join(package, "impls", "moe_layer.py")):
        return Reference(None, None, f"not available ({path} holds no Tutel package)")
    if REFERENCE_MODULE in sys.modules:
        module = sys.modules[REFERENCE_MODULE]
        return Reference(importlib.import_module(f"{REFERENCE_MODULE}.moe"), os.path.dirname(module.__file__), "")
    appended = os.path.abspath(path) not in sys.path
    if appended:
        sys.path.append(os.path.abspath(path))  # its tutel_custom_kernel; appended, so `tutel` stays ours
    spec = importlib.util.spec_from_file_location(REFERENCE_MODULE, os.path.join(package, "__init__.py"),
                                                  submodule_search_locations=[package])
    module = importlib.util.module_from_spec(spec)
    sys.modules[REFERENCE_MODULE] = module
    try:
        spec.loader.exec_module(module)
        moe = importlib.import_module(f"{REFERENCE_MODULE}.moe")
    except Exception as error:  # noqa: BLE001 -- a reference that does not load is a column, not a crash
        for name in [name for name in sys.modules if name.split(".")[0] == REFERENCE_MODULE]:
            del sys.modules[name]
        if appended:
            sys.path.remove(os.path.abspath(path))
        return Reference(None, None, f"not available ({first_line(error)})")
    return Reference(moe, os.path.realpath(package), "")


def first_line(error: BaseException, package_dir: Optional[str] = None) -> str:
    """An exception's type and the first line of its message (cut to 80 characters), and with
    `package_dir`, the innermost place in that package's files it passed through."""
    text = str(error).strip().splitlines()
    line = f"{type(error).__name__}: {text[0] if text else ''}"
    line = line if len(line) <= 80 else line[:77] + "..."
    if package_dir is not None:
        inside = [frame for frame in traceback.extract_tb(error.__traceback__)
                  if os.path.realpath(frame.filename).startswith(package_dir + os.sep)]
        if inside:
            where = os.path.relpath(os.path.realpath(inside[-1].filename), os.path.dirname(package_dir))
            line += f" (at {where}:{inside[-1].lineno})"
    return line


@contextlib.contextmanager
def built_on(device: str, dtype: torch.dtype) -> Iterator[None]:
    """Modules constructed inside get `dtype` parameters on the CPU, real tensors even inside
    fake_cuda() (Tutel 0.3.3's constructor reads a buffer back: int() of a fake or meta tensor raises);
    placed() then makes them fake CUDA tensors."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with unset_fake_temporarily() if device == "fake cuda" else contextlib.nullcontext():
            with torch.device("cpu"):
                yield
    finally:
        torch.set_default_dtype(previous)


def transformers_dir() -> str:
    """The directory of the transformers package (where its backends' errors come from)."""
    import transformers
    return os.path.realpath(os.path.dirname(transformers.__file__))


def placed(module: torch.nn.Module, device: str, dtype: torch.dtype) -> torch.nn.Module:
    """`module` in `dtype` on the CPU, or as fake CUDA tensors (inside fake_cuda())."""
    if device != "fake cuda":
        return module.to(dtype)
    from launch_count import fake_parameters
    from torch._guards import detect_fake_mode
    return fake_parameters(module, detect_fake_mode(), dtype=dtype)


def tensor_device(device: str) -> str:
    """Where a case's tensors are made: "cuda" (fake, inside fake_cuda()) or "cpu"."""
    return "cuda" if device == "fake cuda" else "cpu"


# --------------------------------------------------------------------------------------- candidates

def experts_module(device: str, dtype: torch.dtype, backend: str,
                   shared: Optional[torch.nn.Module] = None) -> torch.nn.Module:
    """Qwen3-MoE's experts module (256 features, 128 per expert, 32 experts) with `backend` as its
    experts implementation; with `shared`, holding that module's parameters (one set of weights for
    every backend, and no configuration change inside a timed call)."""
    import transformers
    from transformers.models.qwen3_moe import modeling_qwen3_moe
    config = transformers.Qwen3MoeConfig(hidden_size=256, moe_intermediate_size=128, num_experts=32,
                                         num_experts_per_tok=8, num_attention_heads=2, num_key_value_heads=1)
    config._experts_implementation = backend
    with built_on(device, dtype):
        module = modeling_qwen3_moe.Qwen3MoeExperts(config)
        if shared is None:  # transformers leaves the weights uninitialised
            torch.manual_seed(0)
            with torch.no_grad():
                for parameter in module.parameters():
                    parameter.normal_(0.0, parameter.shape[-1] ** -0.5)
    if shared is not None:
        for name, parameter in shared.named_parameters():
            setattr(module, name, parameter)
        return module.eval()
    return placed(module, device, dtype).eval()


def routing(tokens: int, hidden: int, experts: int, k: int, dtype: torch.dtype,
            device: str) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random tokens and a top-k routing of them (distinct experts per token, weights summing to 1),
    seeded by `tokens` (on fake tensors values do not exist)."""
    torch.manual_seed(tokens)
    where = tensor_device(device)
    x = torch.randn(tokens, hidden, dtype=dtype, device=where)
    weights, ids = torch.rand(tokens, experts, device=where).topk(k, dim=-1)
    return x, ids, (weights / weights.sum(dim=-1, keepdim=True)).to(dtype)


def make_experts(device: str, tokens: int) -> Tuple[Calls, Dict[str, str]]:
    """The experts case: tutel and transformers' backends on one module's weights and one routing."""
    import tutel.integrations.transformers  # noqa: F401  (registers "tutel")
    dtype = torch.bfloat16
    base = experts_module(device, dtype, "tutel")
    modules = {"tutel": base}
    for backend in TRANSFORMERS_BACKENDS:
        modules[backend] = experts_module(device, dtype, backend, shared=base)
    x, ids, weights = routing(tokens, 256, 32, 8, dtype, device)

    def call(module):
        def run():
            with torch.no_grad():
                return module(x, ids, weights)
        return run
    return {name: call(module) for name, module in modules.items()}, {}


def layer_config(expert_type: str, model_dim: int, hidden: int, experts: int, k: int, reference: bool) -> dict:
    """moe_layer's arguments, Tutel's style; Tutel 0.3.3's 'ffn' gets an explicit ReLU (its default fails)."""
    expert = {"type": expert_type, "num_experts_per_device": experts, "hidden_size_per_expert": hidden}
    if reference and expert_type == "ffn":
        expert["activation_fn"] = torch.nn.functional.relu
    return dict(gate_type={"type": "top", "k": k}, model_dim=model_dim, experts=expert)


def make_layers(expert_type: str, model_dim: int, hidden: int, experts: int, k: int, dtype: torch.dtype,
                reference: Reference) -> Callable[[str, int], Tuple[Calls, Dict[str, str]]]:
    """A moe_layer case's maker: tutel's moe_layer and, where loaded, Tutel 0.3.3's, same arguments."""
    def make(device: str, tokens: int) -> Tuple[Calls, Dict[str, str]]:
        from tutel import moe
        makers = {"tutel": (moe, False)}
        missing = {}
        if reference.moe is not None:
            makers[REFERENCE] = (reference.moe, True)
        else:
            missing[REFERENCE] = reference.reason
        calls: Calls = {}
        torch.manual_seed(tokens)
        x = torch.randn(tokens, model_dim, dtype=dtype, device=tensor_device(device))
        for name, (library, is_reference) in makers.items():
            try:
                torch.manual_seed(0)
                arguments = layer_config(expert_type, model_dim, hidden, experts, k, is_reference)
                with built_on(device, dtype):
                    layer = library.moe_layer(**arguments)
                layer = placed(layer, device, dtype).eval()
            except Exception as error:  # noqa: BLE001 -- the row says why
                missing[name] = f"cannot build: {first_line(error)}"
                continue

            def run(layer=layer):
                with torch.no_grad():
                    return layer(x)
            run.path = layer_path(layer, x)
            calls[name] = run
        return calls, missing
    return make


def layer_path(layer: torch.nn.Module, x: torch.Tensor) -> Optional[str]:
    """The path tutel's moe_layer takes for `x` (tutel.rules.paths.Path's name); None for a layer
    that does not say (Tutel 0.3.3's)."""
    choose = getattr(layer, "choose_path", None)
    if choose is None:
        return None
    try:
        with torch.no_grad():
            return choose(x).path.name
    except Exception as error:  # noqa: BLE001 -- a column, not the run
        return f"? ({first_line(error)})"


def cases(reference: Reference, quick: bool) -> List[Case]:
    """The cases the table shows, in its order."""
    tokens = QUICK_TOKENS if quick else TOKENS
    both = ("cpu", "fake cuda")
    return [
        Case("experts (Qwen3-MoE)", both, tokens, make_experts),
        Case("moe_layer ffn top-2", both, tokens, make_layers("ffn", 256, 128, 32, 2, torch.bfloat16, reference)),
        Case("moe_layer llama_ffn top-8", both, tokens,
             make_layers("llama_ffn", 256, 128, 32, 8, torch.bfloat16, reference)),
        Case("tiny eval moe_layer ffn", ("cpu",), (1,),
             make_layers("ffn", 16, 16, 4, 2, torch.float32, reference)),
    ]


# ---------------------------------------------------------------------------------------- measuring

def count(fn: Callable[[], object], package_dir: str) -> Tuple[CallCount, bool]:
    """`fn` warmed up, then counted twice: the second count and whether both agreed."""
    for _ in range(WARMUP_CALLS):
        fn()
    first = count_calls_under(package_dir, fn)
    second = count_calls_under(package_dir, fn)
    return second, first.by_function == second.by_function


def batch(fn: Callable[[], object], quick: bool) -> Tuple[Callable[[], None], int]:
    """`fn` repeated so that one timed sample lasts about SAMPLE_SECONDS, and the repeat count."""
    if quick:
        return fn, 1
    start = time.perf_counter()
    for _ in range(5):
        fn()
    once = max((time.perf_counter() - start) / 5, 1e-7)
    repeats = max(1, min(1000, int(SAMPLE_SECONDS / once)))

    def run():
        for _ in range(repeats):
            fn()
    return run, repeats


def measure(case: Case, device: str, tokens: int, reference: Reference, reps: int,
            quick: bool) -> List[Dict[str, object]]:
    """The rows of one (case, device, token count): every candidate's counts (and every function of
    its package it called, most called first: `breakdown`), and on the CPU its time."""
    rows: List[Dict[str, object]] = []
    context = fake_cuda() if device == "fake cuda" else contextlib.nullcontext()
    with context:
        try:
            calls, missing = case.make(device, tokens)
        except Exception as error:  # noqa: BLE001
            calls, missing = {}, {"all": f"cannot build: {first_line(error)}"}
        ours_dir = tutel_package_dir()
        shape_keys = shape_function_keys(ours_dir) if device == "fake cuda" else frozenset()
        counted: Calls = {}
        for name, fn in calls.items():
            row: Dict[str, object] = {"case": case.name, "device": device, "T": tokens, "candidate": name}
            package_dir = reference.package_dir if name == REFERENCE else ours_dir
            try:
                result, steady = count(fn, package_dir)
            except Exception as error:  # noqa: BLE001 -- e.g. a host read on fake tensors
                where = transformers_dir() if name in TRANSFORMERS_BACKENDS else package_dir
                row["note"] = ("not traceable: " if device == "fake cuda" else "failed: ") + first_line(error, where)
                rows.append(row)
                continue
            row.update({"package calls": result.package_calls, "steady": "yes" if steady else "no"})
            if getattr(fn, "path", None):
                row["path"] = fn.path
            if device == "fake cuda":
                row["shape fns"] = result.calls_of(shape_keys)
            else:
                row.update({"python calls": result.python_calls, "C calls": result.builtin_calls})
            row["breakdown"] = [[r.calls, r.label()] for r in result.by_function]
            rows.append(row)
            counted[name] = fn
        for name, reason in missing.items():
            rows.append({"case": case.name, "device": device, "T": tokens, "candidate": name, "note": reason})
        if device != "fake cuda" and counted:
            batches = {name: batch(fn, quick) for name, fn in counted.items()}
            times = interleaved_medians({name: run for name, (run, _) in batches.items()}, reps,
                                        warmup=1 if quick else 2)
            for row in rows:
                if row["candidate"] in times:
                    repeats = batches[row["candidate"]][1]
                    row["us/call"] = times[row["candidate"]] / repeats * 1e6
    return rows


def judge(rows: List[Dict[str, object]]) -> None:
    """Fills each row's `target` and `met` where the project sets a target for it."""
    def find(case, device, tokens, candidate):
        return next((r for r in rows if (r["case"], r["device"], r["T"], r["candidate"]) ==
                     (case, device, tokens, candidate)), {})

    for row in rows:
        calls, us = row.get("package calls"), row.get("us/call")
        if row["candidate"] != "tutel":
            continue
        if row["case"].startswith("experts") and row["device"] == "fake cuda":
            row["target"] = f"<= {EXPERTS_CALLS_TARGET} calls"
            row["met"] = _met(calls is not None and calls <= EXPERTS_CALLS_TARGET, calls)
        elif row["case"].startswith("experts"):
            other = find(row["case"], row["device"], row["T"], "batched_mm").get("us/call")
            row["target"] = "us <= batched_mm's" + (f" ({other:.1f})" if other is not None else "")
            row["met"] = _met(us is not None and other is not None and us <= other, other and us)
        elif row["case"].startswith("tiny"):
            other = find(row["case"], row["device"], row["T"], REFERENCE).get("us/call")
            row["target"] = f"us <= {TINY_TIME_TARGET} x {REFERENCE}'s" + (f" ({other:.1f})" if other else "")
            if other and us is not None:
                row["met"] = f"{'yes' if us <= TINY_TIME_TARGET * other else 'no'} ({us / other:.2f}x)"
            else:
                row["met"] = "n/a"
        if row["case"].startswith(("moe_layer", "tiny")):
            layer_target = f"<= {LAYER_CALLS_TARGET} calls"
            verdict = _met(calls is not None and calls <= LAYER_CALLS_TARGET, calls)
            row["target"] = f"{row['target']}; {layer_target}" if row.get("target") else layer_target
            row["met"] = f"{row['met']}; {verdict}" if row.get("met") else verdict


def _met(ok: bool, known) -> str:
    """"yes" / "no", or "n/a" where the number it judges is missing."""
    return "n/a" if known is None else ("yes" if ok else "no")


COLUMNS = ["case", "device", "T", "candidate", "path", "package calls", "shape fns", "python calls", "C calls",
           "us/call", "steady", "target", "met", "note"]


def table(rows: List[Dict[str, object]]) -> str:
    """The markdown table of `rows`."""
    return format_table(rows, COLUMNS)


def breakdowns(rows: List[Dict[str, object]], limit: int) -> str:
    """The `limit` most called functions of each counted row, as plain text blocks."""
    blocks = []
    for row in rows:
        if row.get("breakdown"):
            head = f"{row['case']} | {row['device']} | T={row['T']} | {row['candidate']}: {row['package calls']} calls"
            body = "\n".join(f"{calls:>6}  {label}" for calls, label in row["breakdown"][:limit])
            blocks.append(f"{head}\n{body}")
    return "\n\n".join(blocks)


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, object]:
    """Measures every case; prints the table (and, with --breakdown N, each count's N most called
    functions); writes the JSON and, with --write, the table into the doc.  Returns the result."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tutel-reference", default=None, help="directory holding Tutel 0.3.3's tutel package "
                                                                "and tutel_custom_kernel (see the docstring)")
    parser.add_argument("--reps", type=int, default=None, help="interleaved timing rounds (default 41; --quick 2)")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    parser.add_argument("--quick", action="store_true", help="few tokens and rounds: a check that the script runs")
    parser.add_argument("--breakdown", type=int, default=0, help="print each count's N most called functions")
    parser.add_argument("--only", default=None, help="cases whose name contains this text")
    parser.add_argument("--out", default=RESULTS_DIR, help="directory for host_cost.json")
    args = parser.parse_args(argv)
    reps = args.reps or (2 if args.quick else 41)
    torch.set_num_threads(args.threads)
    reference = load_reference(args.tutel_reference)
    rows: List[Dict[str, object]] = []
    for case in cases(reference, args.quick):
        if args.only and args.only not in case.name:
            continue
        for device in case.devices:
            for tokens in case.tokens:
                rows.extend(measure(case, device, tokens, reference, reps, args.quick))
                print(f"measured {case.name}, {device}, T={tokens}", file=sys.stderr, flush=True)
    judge(rows)
    print(table(rows))
    if args.breakdown:
        print()
        print(breakdowns(rows, args.breakdown))
    result = {"rows": rows, "columns": COLUMNS, "reps": reps, "threads": args.threads, "torch": torch.__version__,
              "reference": reference.reason or f"{REFERENCE} from {args.tutel_reference}",
              "command": " ".join(["python benchmarks/host_cost.py"] + list(sys.argv[1:] if argv is None else argv))}
    write_result(args.out, "host_cost", result, smoke=args.quick)
    return result


if __name__ == "__main__":
    main()
