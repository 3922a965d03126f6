"""tutel.launcher.run / execl, and the OpenMPI rendezvous, with OpenMPI's mpiexec (2 "hosts" on this machine)."""
import os
import re
import shutil
import sys

import pytest

from dist_harness import run_command_on_a_free_port
from install_checks import require
from tutel.launcher import execl, run

MPI_AS_ROOT = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}


@pytest.fixture
def mpiexec():
    """The tests that launch with OpenMPI's mpiexec."""
    require(shutil.which("mpiexec") is not None, "mpiexec", "apt-get install openmpi-bin")


def _mpiexec(program: list, env: dict):
    """Runs `program` on 2 ranks with mpiexec; MASTER_PORT is a free port (retried if taken meanwhile)."""
    exported = [flag for name in [*env, "MASTER_PORT"] for flag in ("-x", name)] + ["-x", "PYTHONPATH"]
    command = ["mpiexec", "-n", "2", "--oversubscribe", *exported, sys.executable, *program]
    output = run_command_on_a_free_port(lambda port: (command, {**MPI_AS_ROOT, **env, "MASTER_PORT": str(port)}),
                                        timeout=180)
    assert output.returncode == 0, output.describe()
    return output


def _launched(stdout: str) -> dict:
    return {int(rank): rest for rank, rest in re.findall(r"launched rank (\d) of 2: (.*?rendezvous = \w+)", stdout)}


def test_mpiexec_launcher_starts_torchrun_on_every_host(mpiexec):
    output = _mpiexec(["-m", "tutel.launcher.run", "-m", "dist_workers_launch"],
                      {"MASTER_ADDR": "127.0.0.1", "LOCAL_SIZE": "1"})
    expected = "sum = 3, LOCAL_SIZE = 1, TUTEL_CUDA_SANDBOX = 1, rendezvous = torchrun"
    assert _launched(output.stdout) == {0: expected, 1: expected}, output.describe()


def test_openmpi_rendezvous_without_the_launcher(mpiexec):
    # LOCAL_RANK is unset: init_data_model_parallel meets at tcp://127.0.0.1:MASTER_PORT with the OpenMPI ranks.
    output = _mpiexec(["-m", "dist_workers_launch"], {})
    expected = "sum = 3, LOCAL_SIZE = None, TUTEL_CUDA_SANDBOX = None, rendezvous = openmpi"
    assert _launched(output.stdout) == {0: expected, 1: expected}, output.describe()
    assert "terminate called" not in output.stderr, "the processes must exit cleanly"


def test_run_builds_the_torchrun_command(monkeypatch):
    for name in ("OMP_NUM_THREADS", "TUTEL_ALLTOALL_ALGO", "MASTER_PORT"):
        monkeypatch.setenv(name, "recorded so that monkeypatch restores it")
        monkeypatch.delenv(name)
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "64")
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "3")
    monkeypatch.setenv("LOCAL_SIZE", "8")
    monkeypatch.setenv("MASTER_ADDR", "host0")
    command = run.build_command(["-m", "pkg.mod", "--flag=1"])
    assert command == [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=8", "--nnodes=64",
                       "--node_rank=3", "--master_addr=host0", "--master_port=23232",
                       "-m", "tutel.launcher.execl", "-m", "pkg.mod", "--flag=1"]
    assert os.environ["TUTEL_ALLTOALL_ALGO"] == "2D" and int(os.environ["OMP_NUM_THREADS"]) >= 1
    monkeypatch.delenv("MASTER_ADDR")
    with pytest.raises(SystemExit, match="MASTER_ADDR"):
        run.build_command(["script.py"])
    monkeypatch.setenv("LOCAL_SIZE", "zero")
    with pytest.raises(SystemExit, match="LOCAL_SIZE"):
        run.build_command(["script.py"])
    with pytest.raises(SystemExit, match="usage"):
        run.build_command([])


def test_execl_builds_the_program_command(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("OMP_NUM_THREADS", "4")  # > 1: no NUMA binding
    monkeypatch.setenv("TUTEL_CUDA_SANDBOX", "2")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert execl.build_command(["-m", "pkg.mod", "-x"]) == [sys.executable, "-m", "pkg.mod", "-x"]
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "1"
    monkeypatch.setenv("TUTEL_CUDA_SANDBOX", "0")
    assert execl.build_command(["script.py", "a"]) == [sys.executable, "script.py", "a"]
    assert os.environ["TUTEL_CUDA_SANDBOX"] == "1"
    with pytest.raises(SystemExit, match="usage"):
        execl.build_command(["-m"])


def test_a_port_taken_before_the_command_binds_it_is_retried(monkeypatch):
    import socket

    import dist_harness
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        ports = iter([taken.getsockname()[1], dist_harness.free_port()])
        monkeypatch.setattr(dist_harness, "free_port", lambda: next(ports))
        used = []
        bind = ("import socket, sys; s = socket.socket(); s.bind(('127.0.0.1', int(sys.argv[1]))); "
                "print('bound', sys.argv[1])")

        def command(port):
            used.append(port)
            return [sys.executable, "-c", bind, str(port)], {}

        output = run_command_on_a_free_port(command, timeout=60)
    assert output.returncode == 0 and len(used) == 2, output.describe()
    assert f"bound {used[1]}" in output.stdout
