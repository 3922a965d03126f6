"""The machine's measured limits, against which the MoE benchmarks express their times.

* GEMM rate: FLOP/s of one large matrix product (``F.linear`` of [4096, K] by [N, K]) in the
  dtype under test: no MoE layer can run its GEMMs faster than the machine runs one big one.
* Read bandwidth: bytes/s of summing a buffer several times larger than the last-level cache:
  at small batches an MoE layer must at least read the weights of the experts it uses once.

On a CUDA device the same two probes run there, larger (an 8192-cube product; a buffer of 8x the
L2 cache and at least 1 GiB), each call followed by a synchronisation so that host timers see the
device's work.
"""
import time
from typing import Callable, Dict, Optional

import torch
import torch.nn.functional as F


def _best_seconds(fn, reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def last_level_cache_bytes() -> int:
    """The largest cache size reported by the OS (32 MiB if it cannot be read)."""
    import glob
    sizes = []
    for path in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
        try:
            text = open(path).read().strip()
        except OSError:
            continue
        scale = {"K": 1 << 10, "M": 1 << 20}.get(text[-1], 1)
        sizes.append(int(text.rstrip("KM")) * scale)
    return max(sizes) if sizes else 32 << 20


def measure_limits(dtypes, smoke: bool, device: str = "cpu") -> Dict[str, float]:
    """{'gemm_gflops_<dtype>': ..., 'read_gbps': ...} for the dtypes under test, on `device`: the
    probes of LimitProbes, each timed alone (best of 5)."""
    limits = {}
    for dtype in dtypes:
        probes = LimitProbes(dtype, smoke, device)
        calls = probes.candidates()
        limits[f"gemm_gflops_{str(dtype).replace('torch.', '')}"] = probes.flops / _best_seconds(calls["gemm_probe"],
                                                                                                  5) / 1e9
        if "read_gbps" not in limits:  # the read does not depend on the dtype
            limits["read_gbps"] = probes.bytes / _best_seconds(calls["read_probe"], 5) / 1e9
    return limits


def cache_reset(smoke: bool, device: str = "cpu") -> Optional[Callable[[], object]]:
    """A call that leaves the CPU caches holding nothing a candidate uses and no dirty lines: a sum
    over a buffer twice the last-level cache.  Run untimed before every timed call, it gives each
    candidate the cache state of a decoding step, whose weights were evicted by the other layers
    since their last use, whatever ran before it.  Without it a candidate's time depended on its
    predecessor: after one that wrote GBs (batched_mm's weight copies) the reads of the next one
    waited for the write-backs of its dirty lines (Qwen3-like T = 16: 18.4 ms in the run against
    14.6 ms after a read).  None on a CUDA device, whose L2 each call's own weights overrun."""
    if torch.device(device).type == "cuda":
        return None
    buffer = torch.ones((1 << 14) if smoke else 2 * last_level_cache_bytes() // 4)
    return buffer.sum


def synchronized(fn: Callable[[], object], device: torch.device) -> Callable[[], object]:
    """`fn` followed by a wait for `device` (CUDA runs asynchronously); `fn` itself elsewhere."""
    if device.type != "cuda":
        return fn

    def run():
        fn()
        torch.cuda.synchronize(device)
    return run


class LimitProbes:
    """The two limits as candidates timed among the others (interleaved), so that they see the
    same load from other processes: one large GEMM in `dtype` and one read of a buffer 8x the
    last-level cache (on CUDA: the L2, at least 1 GiB).  ``rates(times)`` turns their median
    times into FLOP/s and bytes/s."""

    def __init__(self, dtype: torch.dtype, smoke: bool, device: str = "cpu"):
        self.device = torch.device(device)
        on_gpu = self.device.type == "cuda"
        m, k, n = (256, 128, 128) if smoke else (8192, 8192, 8192) if on_gpu else (4096, 1024, 1024)
        self.a = torch.randn(m, k, device=self.device).to(dtype)
        self.b = torch.randn(n, k, device=self.device).to(dtype)
        self.flops = 2.0 * m * n * k
        if smoke:
            numel = 1 << 16
        elif on_gpu:
            numel = max(8 * torch.cuda.get_device_properties(self.device).L2_cache_size, 1 << 30) // 4
        else:
            numel = 8 * last_level_cache_bytes() // 4
        self.buffer = torch.ones(numel, device=self.device)
        self.bytes = numel * 4

    def candidates(self) -> Dict[str, object]:
        return {"gemm_probe": synchronized(lambda: F.linear(self.a, self.b), self.device),
                "read_probe": synchronized(lambda: self.buffer.sum(), self.device)}

    def rates(self, times: Dict[str, float]) -> Dict[str, float]:
        return {"gemm_flops": self.flops / times["gemm_probe"], "read_bytes": self.bytes / times["read_probe"]}


def device_cache_reset(smoke: bool, device: str = "cuda") -> Optional[Callable[[], object]]:
    """cache_reset for event-timed calls on a CUDA device: a sum over a buffer twice the device's L2
    cache, then a wait for the device.  The packed weights of a decoding step are small enough to
    stay in the L2 from one call to the next (Qwen3-30B-A3B's 8 chosen experts in MXFP4: about
    19 MB, against 50 MB on an H100), where a model's other layers would have evicted them; the
    wait leaves the device idle, so that the launches of the timed call start on an idle device
    rather than behind the sum.  None on other devices (see cache_reset)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    buffer = torch.ones((1 << 14) if smoke else max(2 * l2, 1 << 20) // 4, device=device)

    def reset():
        buffer.sum()
        torch.cuda.synchronize(device)
    return reset
