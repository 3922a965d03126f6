"""``python -m tutel.check``: what tutel finds on this machine, and whether its operators agree.

Prints the environment (Python, PyTorch, CUDA, NVRTC and where it was found,
the GPUs and their architectures, the kernel cache), then compares:

* on the CPU: the composite PyTorch operators with the compiled CPU operators;
* on every GPU: the self-check (CUDA kernels against the composite operators on
  that GPU), the CUDA kernels and the composite operators against the CPU
  operators over the operator test cases, the backend tutel then uses, and, in a
  source checkout with pytest installed, the CUDA test files;

and times the compiled operators against the composite ones.  The exit status is
1 if anything disagreed or failed, else 0 (also on a machine without a GPU,
where the GPU checks are reported as skipped).  See docs/cuda-backend.md.
"""
import argparse
import os
import platform
import statistics
import subprocess
import sys
import time
import warnings
from typing import Callable, Dict, List, Optional, Sequence

import torch

from tutel import cuda as tutel_cuda
from tutel._version import __version__
from tutel.cuda_libraries import nvrtc_search_dirs
from tutel.ops import composite
from tutel.ops.backend import BACKEND_VARIABLE, CUDA_BACKENDS, SELF_CHECK_VARIABLE, compiled_operators
from tutel.ops.self_check import FULL_SIZES, OPERATORS, QUICK_SIZES, compare_operators, count_cases

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))  # the installed tutel package

_ENVIRONMENT_VARIABLES = (BACKEND_VARIABLE, SELF_CHECK_VARIABLE, "TUTEL_KERNEL_CACHE", "TUTEL_NVRTC_LIBRARY",
                          "CUDA_HOME", "CUDA_PATH", "CUDA_VISIBLE_DEVICES")
_CUDA_TEST_FILES = ("test_cuda_ops.py", "test_cuda_routing_api.py", "test_composite_ops.py",
                    "test_backend_self_check.py")


class Report:
    """Prints sections and lines, and remembers every failure for the exit status."""

    def __init__(self) -> None:
        self.failures: List[str] = []

    def section(self, title: str) -> None:
        """Starts a titled section."""
        print(f"\n== {title}")

    def line(self, name: str, value: object) -> None:
        """One `name value` line."""
        print(f"  {name:<26} {value}")

    def fail(self, what: str) -> None:
        """Records a failure (the exit status becomes 1)."""
        self.failures.append(what)

    def comparison(self, title: str, results: Dict[str, Optional[str]]) -> None:
        """One line per operator of a compare_operators result; disagreements are failures."""
        for name, problem in results.items():
            self.line(name, "ok" if problem is None else f"MISMATCH: {problem}")
            if problem is not None:
                self.fail(f"{title}: {name}")


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"


def print_environment(report: Report) -> None:
    """Python, PyTorch, tutel's build, the variables that matter, NVRTC, the kernel cache and the GPUs."""
    report.section("environment")
    report.line("python", f"{platform.python_version()} ({sys.executable})")
    report.line("platform", platform.platform())
    report.line("tutel", f"{__version__} ({_PACKAGE_DIR})")
    report.line("pytorch", f"{torch.__version__} (CUDA {torch.version.cuda or 'none: a CPU build'})")
    report.line("tutel built with CUDA", tutel_cuda.is_built())
    for name in _ENVIRONMENT_VARIABLES:
        report.line(name, os.environ.get(name, "(not set)"))

    report.section("NVRTC")
    report.line("search directories", ", ".join(nvrtc_search_dirs()) or "(none exist)")
    if not tutel_cuda.is_built():
        report.line("library", "not used: tutel was built without CUDA support")
    else:
        try:
            path, major, minor = tutel_cuda.nvrtc_info()
            report.line("library", f"{path} (NVRTC {major}.{minor})")
        except RuntimeError as error:
            report.line("library", f"NOT FOUND: {_first_line(error)}")
        try:
            report.line("kernel cache", tutel_cuda.kernel_cache_dir() or "off")
        except RuntimeError as error:
            report.line("kernel cache", _first_line(error))

    report.section("GPUs")
    if not torch.cuda.is_available():
        report.line("devices", "none (torch.cuda.is_available() is False)")
        return
    if torch.version.cuda is not None:
        report.line("driver supports", f"CUDA {_driver_version()}")
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        report.line(f"cuda:{index}", f"{props.name}, sm_{props.major}{props.minor}, "
                                    f"{props.total_memory / 2 ** 30:.1f} GiB, {props.multi_processor_count} SMs")


def _driver_version() -> str:
    try:
        version = torch.cuda.driver_version() if hasattr(torch.cuda, "driver_version") else None
    except RuntimeError:
        version = None
    if not version:
        return "(unknown)"
    return f"{version // 1000}.{(version % 1000) // 10}"


def check_cpu(report: Report, sizes: Sequence) -> None:
    """The composite operators against the compiled CPU operators, on the CPU."""
    cases = sum(count_cases(sizes).values())
    report.section(f"composite operators against the CPU operators (cpu, {cases} calls)")
    report.comparison("cpu composite", compare_operators(composite, compiled_operators(), torch.device("cpu"),
                                                         sizes))


def check_gpu(report: Report, device: torch.device, sizes: Sequence) -> None:
    """Self-check, kernels and composite operators against the CPU operators, and the backend chosen."""
    cpu, compiled = torch.device("cpu"), compiled_operators()
    report.section(f"self-check on {device}: CUDA kernels against the composite operators")
    report.comparison(f"{device} self-check", compare_operators(compiled, composite, device))

    cases = sum(count_cases(sizes).values())
    report.section(f"CUDA kernels against the CPU operators ({device}, {cases} calls)")
    report.comparison(f"{device} kernels", compare_operators(compiled, compiled, device, sizes,
                                                            reference_device=cpu))
    report.section(f"composite operators against the CPU operators ({device}, {cases} calls)")
    report.comparison(f"{device} composite", compare_operators(composite, compiled, device, sizes,
                                                              reference_device=cpu))

    report.section(f"backend in use on {device}")
    CUDA_BACKENDS.forget()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            CUDA_BACKENDS.operators(device)
        except ValueError as error:
            report.line("choice", f"FAILED: {_first_line(error)}")
            report.fail(f"{device} backend choice")
            return
    for message in caught:
        report.line("warning", str(message.message))
    for name, (implementation, reason) in CUDA_BACKENDS.choices()[str(device)].items():
        report.line(name, f"{implementation} ({reason})")


def run_cuda_test_files(report: Report) -> None:
    """Runs the CUDA test files of a source checkout with pytest, when both are there."""
    tests = os.path.join(os.path.dirname(_PACKAGE_DIR), "tests", "python")
    files = [os.path.join(tests, name) for name in _CUDA_TEST_FILES if os.path.isfile(os.path.join(tests, name))]
    report.section("CUDA test files")
    if not files:
        report.line("pytest", "skipped: no source checkout next to this tutel")
        return
    try:
        import pytest  # noqa: F401
    except ImportError:
        report.line("pytest", "skipped: pytest is not installed")
        return
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *files]
    done = subprocess.run(command, cwd=os.path.dirname(os.path.dirname(tests)), capture_output=True, text=True)
    for line in (done.stdout + done.stderr).strip().splitlines()[-15:]:
        print(f"    {line}")
    report.line("pytest exit status", done.returncode)
    if done.returncode != 0:
        report.fail("CUDA test files")


# ------------------------------------------------------------------ timing --

def _timing_problem(device: torch.device, dtype: torch.dtype, tokens: int, model_dim: int):
    experts, k = 16, 2
    generator = torch.Generator().manual_seed(0)
    scores = torch.rand(tokens, experts, generator=generator).softmax(1).to(dtype).to(device)
    indices, _, locations, _ = compiled_operators().route_topk(scores.cpu(), k, False)
    capacity = (tokens * k + experts - 1) // experts
    x = torch.randn(tokens, model_dim, generator=generator).to(dtype).to(device)
    rows = torch.randn(experts, capacity, model_dim, generator=generator).to(dtype).to(device)
    indices, locations = indices.to(device), locations.to(device)
    mask = torch.randint(0, 2, (tokens, experts), generator=generator, dtype=torch.int32).to(device)
    expert_ids = indices.t().contiguous()  # [T, k], as routed experts receive them
    # the experts' up projection of every routed row ([T k, 2 model_dim]) and a gradient of its unit
    gate_up = torch.randn(tokens * k, 2 * model_dim, generator=generator).to(dtype).to(device)
    gate, up = gate_up[:, :model_dim].contiguous(), gate_up[:, model_dim:].contiguous()
    grad = torch.randn(tokens * k, model_dim, generator=generator).to(dtype).to(device)
    swiglu = (1.0, 0.0, None)
    # the routed rows grouped by expert (equal groups), their biases, and each slot's choice
    grouped = torch.randn(tokens * k, model_dim, generator=generator).to(dtype).to(device)
    ends = (torch.arange(1, experts + 1) * (tokens * k // experts)).to(torch.int32).to(device)
    bias = torch.randn(experts, model_dim, generator=generator).to(dtype).to(device)
    slot_choices = compiled_operators().group_by_expert(expert_ids.cpu(), experts)[1].to(device)
    # each expert's [model_dim, model_dim] matrix over the grouped rows
    weight = torch.randn(experts, model_dim, model_dim, generator=generator).to(dtype).to(device)
    grouped_grad = torch.randn(tokens * k, model_dim, generator=generator).to(dtype).to(device)
    logits = torch.randn(tokens, experts, generator=generator).to(dtype).to(device)
    # decode_experts at its largest size (32 tokens), experts of intermediate size model_dim / 2
    decoded = min(tokens, 32)
    decode_weights = torch.rand(decoded, k, generator=generator).to(device)
    scale = model_dim ** -0.5
    up_weight = (torch.randn(experts, model_dim, model_dim, generator=generator) * scale).to(dtype).to(device)
    down_weight = (torch.randn(experts, model_dim, model_dim // 2, generator=generator) * scale).to(dtype).to(device)
    # decode_quantized_experts on the same routing: MXFP4 experts of intermediate size model_dim / 2,
    # random codes and moderate E8M0 scales ([E, N, K / 2] bytes, [E, N, K / 32] scales)
    def mxfp4_stack(rows: int, cols: int):
        codes = torch.randint(0, 256, (experts, rows, cols // 2), generator=generator, dtype=torch.uint8)
        scales = torch.randint(118, 124, (experts, rows, cols // 32), generator=generator, dtype=torch.uint8)
        return codes.to(device), scales.to(device)
    quantized_up, quantized_down = mxfp4_stack(model_dim, model_dim), mxfp4_stack(model_dim, model_dim // 2)
    # quantized_grouped_linear over the grouped rows: each expert's MXFP4 [model_dim, model_dim] matrix
    quantized_square = mxfp4_stack(model_dim, model_dim)
    return {
        "route_topk": lambda ops: ops.route_topk(scores, k, False),
        "assign_locations": lambda ops: ops.assign_locations(indices, experts, None),
        "cumsum_sub_one": lambda ops: ops.cumsum_sub_one(mask),
        "gather_slots": lambda ops: ops.gather_slots(rows, indices, locations, None, None),
        "scatter_slots": lambda ops: ops.scatter_slots(x, indices, locations, None, None, experts, capacity),
        "group_by_expert": lambda ops: ops.group_by_expert(expert_ids, experts),
        "gated_unit": lambda ops: ops.gated_unit(gate_up, *swiglu, False),
        "gated_unit_backward": lambda ops: ops.gated_unit_backward(grad, gate_up, *swiglu, False),
        "gated_unit_pair": lambda ops: ops.gated_unit_pair(gate, up, *swiglu),
        "gated_unit_pair_backward": lambda ops: ops.gated_unit_pair_backward(grad, gate, up, *swiglu),
        "add_expert_bias_": lambda ops: ops.add_expert_bias_(grouped, bias, ends),
        "expert_row_sums": lambda ops: ops.expert_row_sums(grouped, ends),
        "choice_rows": lambda ops: ops.choice_rows(x, slot_choices, k),
        "grouped_rows_linear": lambda ops: ops.grouped_rows_linear(grouped, weight, bias, ends, False),
        "grouped_rows_linear_backward": lambda ops: ops.grouped_rows_linear_backward(
            grouped_grad, grouped, weight, ends, False, [True, True, True]),
        "route_experts": lambda ops: ops.route_experts(logits, k, "softmax", False, None, 0, 0, True, 1.0, False,
                                                       capacity, True),
        "decode_experts": lambda ops: ops.decode_experts(x[:decoded], expert_ids[:decoded], decode_weights, up_weight,
                                                         down_weight, None, None, False, *swiglu, False, None),
        "decode_quantized_experts": lambda ops: ops.decode_quantized_experts(
            x[:decoded], expert_ids[:decoded], decode_weights, "mxfp4", *quantized_up, None, *quantized_down, None, [],
            None, None, "gated", *swiglu, False),
        "quantized_grouped_linear": lambda ops: ops.quantized_grouped_linear(
            grouped, ends, "mxfp4", *quantized_square, None, [], None),
    }


# Operators timed on int32 inputs only, with their label.
_INTEGER_INPUTS = {"cumsum_sub_one": "int32 mask", "group_by_expert": "int32 ids"}


def _elapsed_ms(call: Callable[[], object], device: torch.device) -> float:
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)
    begin = time.perf_counter()
    call()
    return (time.perf_counter() - begin) * 1e3


def time_operators(report: Report, device: torch.device, reps: int) -> None:
    """Median time of one call, compiled against composite, the two interleaved."""
    on_gpu = device.type == "cuda"
    tokens, model_dim = (16384, 2048) if on_gpu else (2048, 256)
    dtypes = (torch.float32, torch.bfloat16) if on_gpu else (torch.float32,)
    compiled_name = "CUDA kernels" if on_gpu else "CPU operators"
    compiled = compiled_operators()
    report.section(f"timing on {device}: {compiled_name} against the composite operators "
                   f"({tokens} tokens, 16 experts, top-2, model_dim {model_dim}; median ms of {reps})")
    for dtype in dtypes:
        problem = _timing_problem(device, dtype, tokens, model_dim)
        for name in OPERATORS:
            if name in _INTEGER_INPUTS and dtype != dtypes[0]:
                continue  # its input is int32 whatever the data dtype
            run = problem[name]
            samples: Dict[str, List[float]] = {"compiled": [], "composite": []}
            for implementation in (compiled, composite):  # warm-up (compiles the kernels)
                run(implementation)
            for _ in range(reps):
                samples["compiled"].append(_elapsed_ms(lambda: run(compiled), device))
                samples["composite"].append(_elapsed_ms(lambda: run(composite), device))
            fast, slow = statistics.median(samples["compiled"]), statistics.median(samples["composite"])
            ratio = slow / fast if fast > 0 else float("inf")
            label = _INTEGER_INPUTS.get(name, str(dtype).replace("torch.", ""))
            report.line(f"{name} {label}",
                        f"{fast:9.3f} ms  composite {slow:9.3f} ms  ({ratio:.1f}x)")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Runs the checks; returns the exit status (1 on any mismatch or failure)."""
    parser = argparse.ArgumentParser(prog="python -m tutel.check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small problems only (the first-use self-check's)")
    parser.add_argument("--no-timing", action="store_true", help="skip the timing")
    parser.add_argument("--no-tests", action="store_true", help="do not run the CUDA test files with pytest")
    parser.add_argument("--reps", type=int, default=20, help="timed calls per operator (default 20)")
    args = parser.parse_args(argv)
    if args.reps < 1:
        parser.error("--reps must be >= 1")
    sizes = QUICK_SIZES if args.quick else FULL_SIZES
    report = Report()
    print_environment(report)
    check_cpu(report, QUICK_SIZES)
    gpus = [torch.device("cuda", i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    if not gpus:
        report.section("GPU checks")
        report.line("skipped", "needs a CUDA device")
    for device in gpus:
        try:
            check_gpu(report, device, sizes)
        except Exception as error:  # noqa: BLE001  (report it and go on to the next device)
            report.line("FAILED", _first_line(error))
            report.fail(f"{device}: {_first_line(error)}")
    if gpus and not args.no_tests:
        run_cuda_test_files(report)
    if not args.no_timing:
        for device in gpus or [torch.device("cpu")]:
            try:
                time_operators(report, device, args.reps)
            except Exception as error:  # noqa: BLE001
                report.line("timing FAILED", _first_line(error))
                report.fail(f"timing on {device}: {_first_line(error)}")
    report.section("result")
    if report.failures:
        report.line("FAILED", "; ".join(report.failures))
        print("\nPlease send this whole output with your report (see docs/cuda-backend.md).")
        return 1
    report.line("passed", "every check that can run here agreed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
