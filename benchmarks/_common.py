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
import random
import resource
import statistics
import subprocess
import sys
import tempfile
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
    parser.add_argument("--memory-rows", default=None, help=argparse.SUPPRESS)  # see add_memory
    parser.add_argument("--config", default=None, help=argparse.SUPPRESS)  # see measure_rows
    parser.add_argument("--config-out", default=None, help=argparse.SUPPRESS)
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


class ForeignLoad:
    """Context manager measuring how many CPUs other processes kept busy while it was open
    (system-wide busy time from /proc/stat minus this process's own CPU time, per second).

    The load average cannot tell: it counts the benchmark itself."""

    value: Optional[float] = None

    @staticmethod
    def _busy_seconds() -> Optional[float]:
        try:
            with open("/proc/stat") as handle:
                fields = [int(v) for v in handle.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
        return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")

    def __enter__(self) -> "ForeignLoad":
        self._start = (self._busy_seconds(), sum(os.times()[:2]), time.perf_counter())
        return self

    def __exit__(self, *exc) -> None:
        busy, own, wall = self._busy_seconds(), sum(os.times()[:2]), time.perf_counter()
        if busy is not None and self._start[0] is not None and wall > self._start[2]:
            foreign = (busy - self._start[0]) - (own - self._start[1])
            self.value = round(max(0.0, foreign) / (wall - self._start[2]), 2)


class Medians(dict):
    """Median seconds per candidate, plus ``foreign_cpus``: the CPUs other processes kept busy
    meanwhile (see ForeignLoad), and ``faults``: each candidate's median page faults per call
    (first touches of fresh memory, which the kernel must zero)."""

    foreign_cpus: Optional[float] = None
    faults: Dict[str, float] = {}


def interleaved_medians(candidates: Dict[str, Callable[[], object]], reps: int, warmup: int = 2,
                        before_each: Optional[Callable[[], object]] = None) -> Medians:
    """Median seconds per call of each candidate; every round runs each candidate once, in an order
    shuffled for each round (seeded, so runs repeat): a candidate that leaves a cost behind (a
    multi-GB buffer freed, caches flushed) does not always hand it to the same successor.  (Mixtral-like
    T = 16 in transformers_moe.py: the candidate after batched_mm, which gathers GBs of weight
    copies, measured 22.8 ms where it takes 13 ms alone.)  `before_each`, when given, runs untimed
    before every timed call, to start each from the same state (see _limits.cache_reset).

    The warm-up rounds also let the allocator's heap grow to what the candidates need together."""
    for _ in range(warmup):
        for fn in candidates.values():
            fn()
    samples: Dict[str, List[float]] = {name: [] for name in candidates}
    faults: Dict[str, List[int]] = {name: [] for name in candidates}
    order = list(candidates)
    shuffler = random.Random(0)
    with ForeignLoad() as foreign:
        for _ in range(reps):
            shuffler.shuffle(order)
            for name in order:
                fn = candidates[name]
                if before_each is not None:
                    before_each()
                faults_before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                start = time.perf_counter()
                fn()
                samples[name].append(time.perf_counter() - start)
                faults[name].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults_before)
    medians = Medians((name, statistics.median(values)) for name, values in samples.items())
    medians.foreign_cpus = foreign.value
    medians.faults = {name: statistics.median(values) for name, values in faults.items()}
    return medians


# ---------------------------------------------------------------------------------------- memory

# mallopt parameters (glibc's malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_MMAP_MAX = -1, -3, -4


_TUNE_ALLOCATOR = True


def _mallopt(*settings, trim: bool = False) -> None:
    if not _TUNE_ALLOCATOR:
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
        for parameter, value in settings:
            libc.mallopt(parameter, value)
        if trim:
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
    _mallopt((_M_MMAP_MAX, 65536), (_M_MMAP_THRESHOLD, threshold), (_M_TRIM_THRESHOLD, threshold), trim=True)


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


def present_columns(rows: List[Dict[str, object]], columns: Sequence[str]) -> List[str]:
    """`columns` without those that no row has (fields a run did not record)."""
    present = {key for row in rows for key in row}
    return [column for column in columns if column in present]


def measure_rows(configs: Sequence[tuple], time_row: Callable[..., Dict[str, object]], columns: Sequence[str],
                 glibc_row: Optional[Callable[..., Dict[str, object]]] = None,
                 script: Optional[str] = None) -> List[Dict[str, object]]:
    """Measures every configuration (see measure_config), printing each row as it comes.

    With `script` (the benchmark's own file), each configuration runs in a fresh process
    (`script --config ...`): the allocator's state left by one configuration (a heap fragmented
    by other sizes) must not slow the next one down.  A smoke run measures in this process.
    Afterwards this process, too, keeps freed memory for reuse."""
    rows: List[Dict[str, object]] = []
    for config in configs:
        if script is not None and _TUNE_ALLOCATOR:
            rows.append(_measure_in_child(script, config))
        else:
            rows.append(measure_config(config, time_row, glibc_row))
        print(format_table(rows[-1:], columns).splitlines()[-1], flush=True)
    retain_freed_memory()
    return rows


def measure_config(config: Sequence, time_row: Callable[..., Dict[str, object]],
                   glibc_row: Optional[Callable[..., Dict[str, object]]]) -> Dict[str, object]:
    """One configuration in two phases, in this order because allocator settings cannot be
    undone: ``glibc_row(*config)`` (if given) under glibc's default malloc, then the row itself,
    ``time_row(*config)``, timed with freed memory kept for reuse (retain_freed_memory)."""
    extra = glibc_row(*config) if glibc_row is not None else {}
    retain_freed_memory()
    row = time_row(*config)
    row.update(extra)
    return row


def _measure_in_child(script: str, config: Sequence) -> Dict[str, object]:
    with tempfile.TemporaryDirectory() as scratch:
        path = os.path.join(scratch, "row.json")
        subprocess.run([sys.executable, script, "--config", json.dumps(list(config)), "--config-out", path,
                        "--threads", str(torch.get_num_threads())], check=True)
        with open(path) as handle:
            return json.load(handle)


def config_child(args: argparse.Namespace, time_row: Callable[..., Dict[str, object]],
                 glibc_row: Optional[Callable[..., Dict[str, object]]] = None) -> bool:
    """In a process measure_rows starts: measures args.config, writes the row, returns True."""
    if not args.config:
        return False
    row = measure_config(json.loads(args.config), time_row, glibc_row)
    with open(args.config_out, "w") as handle:
        json.dump(row, handle)
    return True


def add_memory(rows: List[Dict[str, object]], memory_row: Callable[[Dict[str, object]], None],
               columns: Sequence[str], script: str) -> None:
    """Lets ``memory_row(row)`` add peak memory figures to every row, then prints the table.

    The measurement runs in a fresh process (`script` with --memory-rows) whose allocator has only
    ever mmap'd large blocks: in this process the timings left free memory resident in the heap,
    which a step would reuse without raising the high-water mark.  A smoke run measures in process."""
    if not _TUNE_ALLOCATOR:
        for row in rows:
            memory_row(row)
    else:
        with tempfile.TemporaryDirectory() as scratch:
            path = os.path.join(scratch, "rows.json")
            with open(path, "w") as handle:
                json.dump(rows, handle)
            subprocess.run([sys.executable, script, "--memory-rows", path, "--threads", str(torch.get_num_threads())],
                           check=True)
            with open(path) as handle:
                rows[:] = json.load(handle)
    print(format_table(rows, columns))


def memory_child(args: argparse.Namespace, memory_row: Callable[[Dict[str, object]], None]) -> bool:
    """In the process add_memory starts: measures the rows in args.memory_rows and returns True."""
    if not args.memory_rows:
        return False
    use_mmap_for_large_blocks()
    with open(args.memory_rows) as handle:
        rows = json.load(handle)
    for row in rows:
        memory_row(row)
    with open(args.memory_rows, "w") as handle:
        json.dump(rows, handle)
    return True


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
