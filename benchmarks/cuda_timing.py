"""CUDA-only measurements of one call, beside the synchronised wall-clock times of the benchmarks:
kernels launched per call (torch.profiler), the time per call replayed from a captured CUDA graph,
whether a call runs without host synchronisation (torch.cuda.set_sync_debug_mode), and whether a
graph's replay computes what the eager call computes.

Everything that touches the device is a thin wrapper; what decides a number (which profiler events
count as kernels, which error line a failed capture reports, how the replays are interleaved) is
plain Python that takes its device pieces as arguments, so that the tests check it on a CPU.

Kernel counts: the profiler's events on the CUDA device for one call after warm-up.  Kernels and
the copy engine's work are kept apart: ``kernels`` counts kernel launches only; ``memcpy`` and
``memset`` (cudaMemcpyAsync / cudaMemsetAsync, which the driver may run without a kernel) are
counted separately, and synchronisation records of the profiler ("Event Sync", ...) not at all.
"""
import random
import statistics
from typing import Callable, Dict, Iterable, NamedTuple, Optional, Tuple

import torch

# Event names the CUDA activity of the profiler gives work that is not a kernel.
MEMCPY_PREFIX, MEMSET_PREFIX = "Memcpy", "Memset"
SYNC_NAMES = ("Context Sync", "Stream Sync", "Event Sync", "Stream Wait Event")
ERROR_CHARS = 300  # an error line kept in the JSON is cut to this many characters


def first_line(error: BaseException) -> str:
    """The first non-blank line of `error`'s message (its type's name when the message is empty),
    cut to ERROR_CHARS: what a JSON row keeps of a failure (PyTorch's CUDA errors run to many lines
    of advice after the one that says what happened)."""
    for line in str(error).splitlines():
        if line.strip():
            return line.strip()[:ERROR_CHARS]
    return type(error).__name__


def classify_device_event(name: str) -> str:
    """'memcpy', 'memset', 'sync' or 'kernel' for a profiler event on the CUDA device, by its name."""
    if name.startswith(MEMCPY_PREFIX):
        return "memcpy"
    if name.startswith(MEMSET_PREFIX):
        return "memset"
    if name in SYNC_NAMES:
        return "sync"
    return "kernel"


def count_device_events(events: Iterable[object], calls: int = 1) -> Dict[str, float]:
    """{'kernels', 'memcpy', 'memset'} per call among `events` (profiler FunctionEvents, or anything
    with ``name`` and ``device_type``) of `calls` calls: only the events that ran on a CUDA device
    count; the host-side runtime calls (cudaLaunchKernel ...) and operators are on the CPU."""
    counts = {"kernels": 0, "memcpy": 0, "memset": 0}
    for event in events:
        if getattr(event, "device_type", None) != torch.autograd.DeviceType.CUDA:
            continue
        kind = classify_device_event(event.name)
        if kind == "kernel":
            counts["kernels"] += 1
        elif kind in counts:
            counts[kind] += 1
    return {key: (value // calls if value % calls == 0 else value / calls) for key, value in counts.items()}


def kernels_per_call(fn: Callable[[], object], calls: int = 1, on_device: bool = True) -> Dict[str, float]:
    """count_device_events of `calls` calls of `fn`, profiled with CUDA activity (`on_device`) after
    one warm-up call; the device is synchronised on either side of the calls so that no kernel of
    the warm-up falls inside the window and every kernel of the calls does.  On the device, a
    profile without a single device event raises: the profiler saw nothing (no CUPTI), and a count
    of 0 would read as a call that launches nothing."""
    # The CPU's activity too, so that the device's events are correlated with operators as usual;
    # without `on_device` (a test on a machine without one) the CPU's alone and no synchronisation.
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if on_device else [])
    fn()
    if on_device:
        torch.cuda.synchronize()
    with torch.profiler.profile(activities=activities) as profile:
        for _ in range(calls):
            fn()
        if on_device:
            torch.cuda.synchronize()
    counts = count_device_events(profile.events(), calls)
    if on_device and not any(counts.values()):
        raise RuntimeError("the profiler recorded no event on the CUDA device (is CUPTI available?)")
    return counts


class CapturedGraph(NamedTuple):
    graph: object  # torch.cuda.CUDAGraph
    output: object  # what fn returned during capture: static tensors that every replay overwrites


def capture_error(inner: Optional[BaseException], outer: BaseException) -> str:
    """The error line a failed capture reports: the one `fn` raised inside the capture (`inner`,
    e.g. 'operation not permitted when stream is capturing' from a read back to the host) rather
    than the one torch.cuda.graph's exit raises after it ('operation failed due to a previous error
    during capture'), which says only that something failed."""
    return first_line(inner if inner is not None else outer)


def capture_graph(fn: Callable[[], object], warmup: int = 3) -> CapturedGraph:
    """`fn` captured into a CUDA graph, as PyTorch's documentation asks: `warmup` calls on a side
    stream first (lazy initialisation, autotuning and the allocator's first blocks stay out of the
    graph), then one call under torch.cuda.graph.  Raises what the capture raised, preferring the
    error of `fn` itself (see capture_error); the current stream is restored either way
    (torch.cuda.graph leaves its capture stream current when ending the capture raises)."""
    previous = torch.cuda.current_stream()
    side = torch.cuda.Stream()
    side.wait_stream(previous)
    try:
        with torch.cuda.stream(side):
            for _ in range(warmup):
                fn()
        previous.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        inner: Optional[BaseException] = None
        try:
            with torch.cuda.graph(graph):
                try:
                    output = fn()
                except Exception as error:  # kept: the exit of torch.cuda.graph may raise over it
                    inner = error
                    raise
        except Exception as outer:
            raise RuntimeError(capture_error(inner, outer)) from outer
    finally:
        torch.cuda.set_stream(previous)
    return CapturedGraph(graph, output)


def try_capture(fn: Callable[[], object], warmup: int = 3,
                capture: Callable[..., CapturedGraph] = capture_graph) -> Tuple[Optional[CapturedGraph], Optional[str]]:
    """(captured graph, None), or (None, the error's first line) when the capture fails: a backend
    that cannot be captured (it reads a size back to the host, or synchronises) is a result to
    record, not a reason to stop the run."""
    try:
        return capture(fn, warmup=warmup), None
    except Exception as error:  # noqa: BLE001 -- any failure of a capture is recorded the same way
        _settle_device()
        return None, first_line(error)


def _settle_device() -> None:
    """Waits for the device after a failed capture, ignoring an error there: what the capture left
    queued must not land in the next candidate's timing."""
    try:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    except Exception:  # noqa: BLE001 -- the capture's own error is already recorded
        pass


def _cuda_timing_event() -> object:
    return torch.cuda.Event(enable_timing=True)


def interleaved_event_medians(candidates: Dict[str, Callable[[], object]], reps: int, warmup: int = 1,
                              make_event: Callable[[], object] = _cuda_timing_event,
                              before_each: Optional[Callable[[], object]] = None) -> Dict[str, float]:
    """Median milliseconds per call of each candidate, timed with device events around each call:
    the rounds of _common.interleaved_medians (`warmup` untimed rounds, then `reps` rounds each
    running every candidate once, in an order shuffled per round from the same seed), with the
    host clock and its synchronisation replaced by events recorded on the current stream, for calls
    (graph replays) that take microseconds.  `before_each`, when given, runs untimed before every
    timed call (_limits.device_cache_reset: the device's caches emptied and the device idle again,
    so that no launch of the call hides behind work still queued)."""
    for _ in range(warmup):
        for fn in candidates.values():
            fn()
    samples: Dict[str, list] = {name: [] for name in candidates}
    order = list(candidates)
    shuffler = random.Random(0)
    for _ in range(reps):
        shuffler.shuffle(order)
        for name in order:
            if before_each is not None:
                before_each()
            start, end = make_event(), make_event()
            start.record()
            candidates[name]()
            end.record()
            end.synchronize()
            samples[name].append(start.elapsed_time(end))
    return {name: statistics.median(values) for name, values in samples.items()}


def graph_replay_fields(calls: Dict[str, Callable[[], object]], reps: int,
                        capture: Callable[..., Tuple[Optional[CapturedGraph], Optional[str]]] = try_capture,
                        medians: Callable[..., Dict[str, float]] = interleaved_event_medians) -> Dict[str, object]:
    """<name>_graph_ms of every candidate: each captured into its own CUDA graph (`capture`, as
    try_capture), the replays of those that captured timed in `reps` interleaved rounds (`medians`,
    as interleaved_event_medians), then the graphs freed; a candidate that did not capture gets None
    and <name>_graph_error."""
    fields: Dict[str, object] = {}
    graphs, replays = {}, {}
    for name, fn in calls.items():
        captured, error = capture(fn)
        if captured is None:
            fields[f"{name}_graph_ms"] = None
            fields[f"{name}_graph_error"] = error
        else:
            graphs[name] = captured.graph
    if graphs:
        replays = {name: graph.replay for name, graph in graphs.items()}
        fields.update((f"{name}_graph_ms", ms) for name, ms in medians(replays, reps).items())
    del graphs, replays  # their private memory pools go back before the next case
    torch.cuda.empty_cache()
    return fields


def _set_cuda_sync_mode(mode: object) -> None:
    torch.cuda.set_sync_debug_mode(mode)


def _get_cuda_sync_mode() -> object:
    return torch.cuda.get_sync_debug_mode()


def sync_free(steps: Dict[str, Callable[[], object]], set_mode: Callable[[object], None] = _set_cuda_sync_mode,
              get_mode: Callable[[], object] = _get_cuda_sync_mode) -> Tuple[bool, Optional[str]]:
    """(True, None) when every step runs under sync debug mode "error" without a synchronising
    CUDA call, else (False, '<step>: <first line of the error>') for the first step that synchronised.
    Each step runs once before, outside the mode: first-use work (kernel compilation, library
    handles) is not what a training or decoding step repeats.  The mode in force before is restored
    whatever happens."""
    for step in steps.values():
        step()
    before = get_mode()
    for name, step in steps.items():
        set_mode("error")
        try:
            step()
        except Exception as error:  # noqa: BLE001 -- the sync check's RuntimeError, or any other
            return False, f"{name}: {first_line(error)}"
        finally:
            set_mode(before)
    return True, None


def outputs_match(eager: torch.Tensor, replayed: torch.Tensor) -> Dict[str, object]:
    """How a graph replay's output compares with the eager call's: 'bitwise' (torch.equal),
    'relative' (||replayed - eager|| / ||eager|| in float64) and 'equal': bitwise, or within one
    unit of rounding of the dtype (its machine epsilon, relative), for paths whose reductions may
    run in another order on replay."""
    bitwise = bool(torch.equal(eager, replayed))
    reference = eager.detach().double()
    relative = 0.0 if bitwise else float((replayed.detach().double() - reference).norm()
                                         / reference.norm().clamp_min(1e-30))
    eps = torch.finfo(eager.dtype).eps if eager.dtype.is_floating_point else 0.0
    return {"bitwise": bitwise, "relative": relative, "equal": bitwise or relative <= eps}
