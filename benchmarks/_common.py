"""Shared pieces of the benchmark scripts: interleaved timing, peak memory, the machine's
description, tables and JSON results.

Timings are medians over repetitions in which every candidate runs once per round, in turn,
so that background load affects the candidates alike; ratios between candidates of one run
are what the reports compare.
"""
import argparse
import ctypes
import gc
import json
import os
import platform
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

RESULTS_DIR = os.path.join(ROOT, "benchmarks", "results")


def parse_args(description: str, argv: Optional[Sequence[str]], default_reps: int) -> argparse.Namespace:
    """The options every benchmark takes: --smoke (tiny shapes, one repetition), --reps, --out, --threads."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes and one repetition (CI)")
    parser.add_argument("--reps", type=int, default=None, help=f"timed repetitions (default {default_reps})")
    parser.add_argument("--out", default=RESULTS_DIR, help="directory for the JSON result")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2)")
    args = parser.parse_args(argv)
    if args.reps is None:
        args.reps = 1 if args.smoke else default_reps
    torch.set_num_threads(args.threads)
    # A smoke run may share its process with others (CI runs it inside pytest): it leaves the
    # allocator's settings alone (its memory figures mean nothing anyway).
    global _TUNE_ALLOCATOR
    _TUNE_ALLOCATOR = not args.smoke
    return args


def load_average() -> Optional[float]:
    """The 1-minute load average (None where the OS does not report one)."""
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> Dict[str, object]:
    """What the numbers were measured on."""
    return {
        "cpu": cpu_model(),
        "logical_cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "os": platform.platform(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }


def interleaved_medians(candidates: Dict[str, Callable[[], object]], reps: int, warmup: int = 1) -> Dict[str, float]:
    """Median seconds per call of each candidate; every round runs each candidate once, in turn."""
    for _ in range(warmup):
        for fn in candidates.values():
            fn()
    samples: Dict[str, List[float]] = {name: [] for name in candidates}
    for _ in range(reps):
        for name, fn in candidates.items():
            start = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in samples.items()}


# ---------------------------------------------------------------------------------------- memory

# mallopt parameters (glibc's malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_MMAP_MAX = -1, -3, -4


_TUNE_ALLOCATOR = True


def _mallopt(*settings) -> None:
    if not _TUNE_ALLOCATOR:
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
        for parameter, value in settings:
            libc.mallopt(parameter, value)
        libc.malloc_trim(0)
    except (OSError, AttributeError):
        pass


def retain_freed_memory() -> None:
    """Makes glibc keep freed memory for reuse instead of giving it back to the OS (no mmap for
    large blocks, no trimming), as caching allocators (jemalloc, tcmalloc) do, so repeated
    allocations of a size do not fault fresh pages in.

    Under glibc's defaults blocks above 32 MiB are always mmap'd and smaller ones are often
    trimmed, so an operator returning a large fresh tensor first pays the kernel for zeroing its
    pages; how often depends on tensor sizes and allocation history rather than on the code
    being measured."""
    _mallopt((_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, 2**31 - 1))


def use_mmap_for_large_blocks(threshold: int = 1 << 16) -> None:
    """Makes glibc serve blocks above `threshold` with mmap and give them back on free, and
    returns the heap's free memory, so the resident set follows the live tensors (by default
    freed memory may stay in the heap).

    Call it after the timings: it also makes every large allocation fault its pages in afresh,
    which is not how the library runs by default."""
    _mallopt((_M_MMAP_MAX, 65536), (_M_MMAP_THRESHOLD, threshold), (_M_TRIM_THRESHOLD, threshold))


def _status_kib(field: str) -> Optional[int]:
    try:
        with open("/proc/self/status") as handle:
            for line in handle:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def peak_memory_mib(fn: Callable[[], object]) -> Optional[float]:
    """Peak resident memory that `fn()` adds above the memory resident when it starts, in MiB.

    Uses Linux's resettable high-water mark (writing 5 to /proc/self/clear_refs); returns None
    where that is unavailable."""
    gc.collect()
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
    except OSError:
        return None
    before = _status_kib("VmRSS")
    fn()
    peak = _status_kib("VmHWM")
    if before is None or peak is None:
        return None
    return max(0, peak - before) / 1024.0


# ---------------------------------------------------------------------------------------- output

def format_table(rows: List[Dict[str, object]], columns: Sequence[str]) -> str:
    """A markdown table of `rows` (dicts) restricted to `columns`; floats get 3 significant digits."""
    def cell(value):
        if isinstance(value, float):
            return f"{value:.3g}" if abs(value) < 1e4 else f"{value:,.0f}"
        return "" if value is None else str(value)

    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(cell(row.get(column)) for column in columns) + " |")
    return "\n".join(lines)


def measure_rows(configs: Sequence[tuple], time_row: Callable[..., Dict[str, object]], columns: Sequence[str],
                 glibc_row: Optional[Callable[..., Dict[str, object]]] = None) -> List[Dict[str, object]]:
    """Times every configuration in two phases, in this order because allocator settings
    cannot be undone:

    1. ``glibc_row(*config)``, if given: figures under glibc's default malloc;
    2. ``time_row(*config)``: the row, timed with freed memory kept for reuse
       (retain_freed_memory), printed as it comes.

    Timings taken after this call still run with retained memory; add_memory comes last."""
    under_glibc = [glibc_row(*config) for config in configs] if glibc_row is not None else [{}] * len(configs)
    retain_freed_memory()
    rows: List[Dict[str, object]] = []
    for config, extra in zip(configs, under_glibc):
        rows.append(time_row(*config))
        rows[-1].update(extra)
        print(format_table(rows[-1:], columns).splitlines()[-1], flush=True)
    return rows


def add_memory(rows: List[Dict[str, object]], memory_row: Callable[[Dict[str, object]], None],
               columns: Sequence[str]) -> None:
    """With large blocks mmap'd from now on, lets ``memory_row(row)`` add peak memory figures to
    every row; prints the finished table."""
    use_mmap_for_large_blocks()
    for row in rows:
        memory_row(row)
    print(format_table(rows, columns))


def write_result(out_dir: str, name: str, payload: Dict[str, object], smoke: bool) -> str:
    """Writes `payload` plus the machine description and load to <out_dir>/<name>.json."""
    os.makedirs(out_dir, exist_ok=True)
    payload = dict(payload)
    payload.update(benchmark=name, smoke=smoke, machine=machine(), load_average_after=load_average(),
                   finished=time.strftime("%Y-%m-%d %H:%M:%S"))
    path = os.path.join(out_dir, f"{name}.json")
    with open(path, "w") as handle:
        json.dump(payload, handle, indent=1)
    return path
