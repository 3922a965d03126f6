"""Runs the program of one local process started by ``tutel.launcher.run`` (through torchrun).

    python3 -m tutel.launcher.execl [-m] <module or script> [args...]

``TUTEL_CUDA_SANDBOX=2`` restricts the process to the GPU of its LOCAL_RANK
(``CUDA_VISIBLE_DEVICES``); otherwise ``TUTEL_CUDA_SANDBOX=1`` is set.  When
``OMP_NUM_THREADS`` is 1 and ``numactl`` is installed, the process is bound to
the NUMA node(s) matching its local rank.  Then it replaces itself with
``python3 [-m] <module or script> [args...]``.
"""
import logging
import os
import re
import sys
from typing import List, Optional

from tutel.launcher import exec_command

NUMACTL = "/usr/bin/numactl"
NUMA_ROOT = "/sys/devices/system/node"


def _local_size() -> int:
    for name in ("LOCAL_SIZE", "LOCAL_WORLD_SIZE"):
        raw = os.environ.get(name, "").strip()
        if raw.isdigit() and int(raw) > 0:
            return int(raw)
    return 1


def numa_binding(local_rank: int, local_size: int) -> List[str]:
    """``numactl --cpunodebind=...`` for this local rank, or [] when binding does not apply."""
    if int(os.environ.get("OMP_NUM_THREADS", "1") or 1) > 1 or not os.path.exists(NUMACTL):
        return []
    try:
        nodes = sorted((name[4:] for name in os.listdir(NUMA_ROOT) if re.fullmatch(r"node[0-9]+", name)), key=int)
    except OSError:
        return []
    if not nodes:
        return []
    if len(nodes) <= local_size:
        chosen = [nodes[(local_rank * len(nodes) // local_size) % len(nodes)]]
    else:
        chosen = nodes[local_rank::local_size]
    return [NUMACTL, f"--cpunodebind={','.join(chosen)}"]


def build_command(argv: List[str]) -> List[str]:
    """The command line of this process (sets the CUDA sandbox variables)."""
    as_module = bool(argv) and argv[0] == "-m"
    rest = argv[1:] if as_module else argv
    if not rest:
        raise SystemExit("usage: python3 -m tutel.launcher.execl [-m] <module or script> [args...]")
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if os.environ.get("TUTEL_CUDA_SANDBOX", "0") == "2":
        os.environ["CUDA_VISIBLE_DEVICES"] = str(local_rank)
    else:
        os.environ["TUTEL_CUDA_SANDBOX"] = "1"
    binding = numa_binding(local_rank, _local_size())
    if not binding and local_rank == 0 and int(os.environ.get("OMP_NUM_THREADS", "1") or 1) <= 1:
        logging.warning("`numactl` is not enabled by tutel.launcher.execl")
    return binding + [sys.executable] + (["-m"] if as_module else []) + rest


def main(argv: Optional[List[str]] = None) -> None:
    """Becomes the program of ``build_command(argv)`` (default: sys.argv[1:])."""
    exec_command(build_command(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    main()
