"""The on-disk kernel cache with real processes: two processes compiling into an
empty cache at once, damaged entries recompiled, the cache switched off or
unwritable.  Skipped without a CUDA device (tests/cpp/test_kernel_cache.cpp
covers the file format and atomic writes without one)."""
import os
import struct
import subprocess
import sys
import time

import pytest

from cuda_compare import cuda_available

pytestmark = pytest.mark.skipif(not cuda_available, reason="needs a CUDA device")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Announces itself with the file argv[2], waits for the file argv[1] (so that several workers
# start together), then runs every kernel family once and prints a digest of the results.
WORKER = r"""
import os, sys, time
open(sys.argv[2], "w").close()
while not os.path.exists(sys.argv[1]):
    time.sleep(0.01)
import torch
import tutel
from tutel import moe
torch.manual_seed(0)
scores = torch.rand(500, 16, device="cuda").softmax(1)
x = torch.randn(500, 32, device="cuda")
crit, _ = moe.top_k_routing(scores, top_k=2, batch_prioritized_routing=True)
y = moe.fast_decode(moe.fast_encode(x, crit), crit)
c = torch.ops.tutel.cumsum_sub_one(torch.ones(9, 3, device="cuda"))
tutel.cuda.check_errors()
print(repr(float(y.double().sum())), repr(float(c.sum())), "cache=" + tutel.cuda.kernel_cache_dir())
"""


def run_workers(count, env, tmp_path):
    go = tmp_path / f"go-{time.monotonic_ns()}"
    environment = {**os.environ, **env, "PYTHONPATH": ROOT}
    ready = [tmp_path / f"{go.name}-ready-{index}" for index in range(count)]
    workers = [subprocess.Popen([sys.executable, "-c", WORKER, str(go), str(flag)], env=environment, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE) for flag in ready]
    deadline = time.monotonic() + 120  # generous: only reached if a worker fails to start
    while not all(flag.exists() for flag in ready) and time.monotonic() < deadline:
        time.sleep(0.01)  # every worker waits at the start line: then they start together
    go.touch()
    results = [worker.communicate(timeout=600) for worker in workers]
    for worker, (out, err) in zip(workers, results):
        assert worker.returncode == 0, err
    return results


def fnv1a64(data: bytes, value: int = 0xcbf29ce484222325) -> int:
    for byte in data:
        value = ((value ^ byte) * 0x100000001b3) & 0xFFFFFFFFFFFFFFFF
    return value


def parse_entry(path):
    """(key, payload) of a cache file, asserting it is complete and intact."""
    data = path.read_bytes()
    assert data[:8] == b"TUTELKC1", path
    key_size, payload_size, checksum = struct.unpack("<QQQ", data[8:32])
    assert len(data) == 32 + key_size + payload_size, path
    key, payload = data[32:32 + key_size], data[32 + key_size:]
    assert fnv1a64(payload, fnv1a64(key)) == checksum, path
    assert key.startswith(b"tutel kernel v1\n"), key
    return key, payload


def entries(directory):
    return sorted(directory.iterdir())


def test_two_processes_compile_into_an_empty_cache_at_once(tmp_path):
    cache = tmp_path / "cache"
    (first, _), (second, _) = run_workers(2, {"TUTEL_KERNEL_CACHE": str(cache)}, tmp_path)
    assert first == second and first.split()[-1] == f"cache={cache}"
    files = entries(cache)
    assert len(files) >= 4, files  # routing, slot assignment, dispatch, cumsum
    for path in files:
        assert path.suffix == ".bin", f"temporary file left behind: {path}"
        parse_entry(path)
    # A third process finds everything cached and computes the same.
    mtimes = {path: path.stat().st_mtime_ns for path in files}
    (third, _), = run_workers(1, {"TUTEL_KERNEL_CACHE": str(cache)}, tmp_path)
    assert third == first
    assert {path: path.stat().st_mtime_ns for path in entries(cache)} == mtimes


@pytest.mark.parametrize("damage", ["truncate", "flip_payload_byte", "valid_header_garbage_binary"])
def test_a_damaged_entry_is_compiled_again(tmp_path, damage):
    cache = tmp_path / "cache"
    env = {"TUTEL_KERNEL_CACHE": str(cache)}
    (reference, _), = run_workers(1, env, tmp_path)
    damaged = {}
    for path in entries(cache):
        key, payload = parse_entry(path)
        if damage == "truncate":
            data = path.read_bytes()[: 32 + len(key) + len(payload) // 2]
        elif damage == "flip_payload_byte":
            data = bytearray(path.read_bytes())
            data[-7] ^= 0x40
            data = bytes(data)
        else:  # passes every file check, but the driver cannot load it
            garbage = b"this is not a CUDA binary\0"
            data = b"TUTELKC1" + struct.pack("<QQQ", len(key), len(garbage),
                                             fnv1a64(garbage, fnv1a64(key))) + key + garbage
        path.write_bytes(data)
        damaged[path] = data
    (again, _), = run_workers(1, env, tmp_path)
    assert again == reference
    for path, data in damaged.items():
        assert path.read_bytes() != data, f"{path} was not rewritten"
        parse_entry(path)


def test_the_disk_cache_can_be_switched_off(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    (out, _), = run_workers(1, {"TUTEL_KERNEL_CACHE": "off", "HOME": str(home), "XDG_CACHE_HOME": str(home)},
                           tmp_path)
    assert out.split()[-1] == "cache=" and not list(home.rglob("*tutel*"))


def test_an_unwritable_cache_warns_and_still_works(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("a file, not a directory")
    (out, err), = run_workers(1, {"TUTEL_KERNEL_CACHE": str(blocker / "cache")}, tmp_path)
    assert "cannot write the CUDA kernel cache" in err
    (reference, _), = run_workers(1, {"TUTEL_KERNEL_CACHE": "off"}, tmp_path)
    assert out.split()[:2] == reference.split()[:2]
