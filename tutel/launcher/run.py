"""Starts the local processes of one host of an ``mpiexec`` launch.

    mpiexec -bind-to none -host h1,h2 -x MASTER_ADDR=h1 -x LOCAL_SIZE=8 \\
        python3 -m tutel.launcher.run -m tutel.examples.helloworld --batch_size=16

mpiexec starts one copy of this module per host (``OMPI_COMM_WORLD_SIZE`` hosts,
this one being ``OMPI_COMM_WORLD_RANK``); it replaces itself with
``python3 -m torch.distributed.run`` starting ``LOCAL_SIZE`` (default 1) processes
here, each running ``tutel.launcher.execl`` and then the given module or script.
The processes of all hosts meet at ``MASTER_ADDR:MASTER_PORT`` (default port
23232; MASTER_ADDR may be omitted with a single host).

Environment passed on: ``LOCAL_SIZE`` (used by the 2D-hierarchical all-to-all),
``OMP_NUM_THREADS`` (when unset: the host's CPUs divided among the local
processes), and ``TUTEL_ALLTOALL_ALGO=2D`` for >= 64 hosts of >= 8 processes
(kept for compatibility; the library does not read it).  Without mpiexec this
runs as a single host.
"""
import os
import sys
from typing import List, Optional

from tutel.launcher import exec_command

DEFAULT_MASTER_PORT = 23232


def _positive_int(name: str, default: int) -> int:
    raw = os.environ.get(name, "").strip() or str(default)
    if not raw.isdigit() or int(raw) < 1:
        raise SystemExit(f"tutel.launcher.run: {name}={raw!r} is not valid; allowed: a positive integer")
    return int(raw)


def build_command(argv: List[str]) -> List[str]:
    """The torch.distributed.run command line for this host (sets the environment it passes on)."""
    if not argv:
        raise SystemExit("usage: python3 -m tutel.launcher.run [-m] <module or script> [args...]")
    host_size = _positive_int("OMPI_COMM_WORLD_SIZE", 1)
    host_rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", 0))
    local_size = _positive_int("LOCAL_SIZE", 1)
    os.environ["LOCAL_SIZE"] = str(local_size)
    if "TUTEL_ALLTOALL_ALGO" not in os.environ and host_size >= 64 and local_size >= 8:
        os.environ["TUTEL_ALLTOALL_ALGO"] = "2D"
    if "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // local_size))
    master_addr = os.environ.get("MASTER_ADDR", "")
    if not master_addr:
        if host_size > 1:
            raise SystemExit("tutel.launcher.run: MASTER_ADDR is not set; a launch over several hosts needs "
                             "`-x MASTER_ADDR=<first host>`")
        master_addr = "localhost"
    master_port = _positive_int("MASTER_PORT", DEFAULT_MASTER_PORT)
    return [sys.executable, "-m", "torch.distributed.run",
            f"--nproc_per_node={local_size}", f"--nnodes={host_size}", f"--node_rank={host_rank}",
            f"--master_addr={master_addr}", f"--master_port={master_port}",
            "-m", "tutel.launcher.execl"] + list(argv)


def main(argv: Optional[List[str]] = None) -> None:
    """Becomes the torchrun of ``build_command(argv)`` (default: sys.argv[1:])."""
    exec_command(build_command(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    main()
