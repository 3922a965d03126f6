"""Runs test code in N real processes (gloo on 127.0.0.1) and reports every rank's output.

For the distributed tests (collectives here; the MoE layer's tests can use it the same way)::

    from dist_harness import launch

    def test_something():
        result = launch("dist_workers_collectives:check_everything", world_size=4,
                        env={"LOCAL_SIZE": "2"}, args=("float64",))
        result.check()          # AssertionError with every rank's output on failure
        assert "..." in result.ranks[0].stdout

* ``target`` is ``"module:function"``; the module is imported from this directory (or
  anywhere on sys.path: the repository root is on it).  Each rank calls
  ``function(*args)`` (args as strings) in a fresh ``python`` process.
* Each rank gets the torchrun environment -- RANK, WORLD_SIZE, LOCAL_RANK,
  LOCAL_WORLD_SIZE (= world_size: one host), MASTER_ADDR=127.0.0.1 and a free
  MASTER_PORT -- plus OMP_NUM_THREADS=1 and TUTEL_GLOBAL_TIMEOUT_SEC=60, so a
  hung collective fails within a minute; ``env`` overrides or adds variables (a
  value None removes one).  The function joins the process group itself, usually
  with ``init_gloo()`` below (tutel.system.init_data_model_parallel(backend='gloo')).
* A rank whose function raises prints the traceback and exits at once with status
  1, so its peers fail quickly (their collectives lose the connection) instead of
  waiting for the timeout.  A rank whose function returns exits at once too, with
  status 0, past the interpreter's teardown: PyTorch 2.6's gloo can hang there,
  destroying process groups after every check passed (the tests check what the
  function does, not how PyTorch tears its groups down).
* The whole launch is killed after ``timeout`` seconds (``result.timed_out``).
* Output goes to files (no pipe can fill up); ``result.ranks[r].stdout/.stderr``.
* A launch whose rank 0 could not bind the port (another program took it) is
  retried with a new port.

Process start-up (importing torch) dominates the cost: batch several checks
into one launch.  ``run_command`` runs any other command line (torchrun,
mpiexec) with the same timeout and report.
"""
import importlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))

# Variables of an enclosing launcher that would confuse the ranks' rendezvous.
_LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                       "MASTER_ADDR", "MASTER_PORT", "LOCAL_SIZE", "TORCHELASTIC_RUN_ID")
_PORT_TAKEN = ("Address already in use", "EADDRINUSE", "address already in use")


def free_port() -> int:
    """A TCP port that is free on 127.0.0.1 right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def clean_environment(extra: Optional[Dict[str, Optional[str]]] = None) -> Dict[str, str]:
    """os.environ without launcher/MPI variables, with the repository on PYTHONPATH, plus ``extra``."""
    env = {key: value for key, value in os.environ.items()
           if key not in _LAUNCHER_VARIABLES and not key.startswith(("OMPI_", "PMIX_", "TORCHELASTIC_"))}
    env["PYTHONPATH"] = os.pathsep.join([REPO_ROOT, HERE] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("TUTEL_GLOBAL_TIMEOUT_SEC", "60")
    for key, value in (extra or {}).items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = str(value)
    return env


@dataclass
class ProcessOutput:
    """Exit status and captured output of one process (``returncode`` None: killed at the timeout)."""

    name: str
    returncode: Optional[int]
    stdout: str
    stderr: str

    def describe(self, tail: int = 4000) -> str:
        return (f"---- {self.name}: exit status {self.returncode}\n"
                f"[stdout]\n{self.stdout[-tail:]}\n[stderr]\n{self.stderr[-tail:]}")


@dataclass
class LaunchResult:
    """Outputs of every process of a launch, in rank order."""

    ranks: List[ProcessOutput]
    elapsed: float
    timed_out: bool
    what: str = ""
    attempts: int = 1

    def check(self) -> "LaunchResult":
        """Raises AssertionError (with every process's output) unless all exited with status 0 in time."""
        if self.timed_out or any(rank.returncode != 0 for rank in self.ranks):
            reason = "timed out" if self.timed_out else "failed"
            raise AssertionError(f"{self.what} {reason} after {self.elapsed:.1f} s\n"
                                 + "\n".join(rank.describe() for rank in self.ranks))
        return self

    def describe(self) -> str:
        return "\n".join(rank.describe() for rank in self.ranks)


@dataclass
class _Running:
    name: str
    process: subprocess.Popen
    stdout_path: str
    stderr_path: str
    files: list = field(default_factory=list)


def _start(name: str, argv: Sequence[str], env: Dict[str, str], directory: str) -> _Running:
    stdout_path = os.path.join(directory, f"{name}.out")
    stderr_path = os.path.join(directory, f"{name}.err")
    stdout, stderr = open(stdout_path, "w"), open(stderr_path, "w")
    process = subprocess.Popen(list(argv), env=env, cwd=REPO_ROOT, stdout=stdout, stderr=stderr,
                               stdin=subprocess.DEVNULL, start_new_session=True)
    return _Running(name, process, stdout_path, stderr_path, [stdout, stderr])


def _wait_all(running: List[_Running], timeout: float) -> bool:
    """Waits for every process; kills the process groups of those left at the deadline. True if any was."""
    deadline = time.monotonic() + timeout
    timed_out = False
    for item in running:
        try:
            item.process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
    for item in running:
        if item.process.poll() is None:
            try:
                os.killpg(item.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            item.process.wait()
    return timed_out


def _collect(running: List[_Running], timed_out: bool) -> List[ProcessOutput]:
    outputs = []
    for item in running:
        for handle in item.files:
            handle.close()
        with open(item.stdout_path, errors="replace") as out, open(item.stderr_path, errors="replace") as err:
            code = None if timed_out and item.process.returncode in (-signal.SIGKILL,) else item.process.returncode
            outputs.append(ProcessOutput(item.name, code, out.read(), err.read()))
    return outputs


def run_processes(commands: Dict[str, Sequence[str]], envs: Dict[str, Dict[str, str]], timeout: float,
                  what: str) -> LaunchResult:
    """Starts every named command at once and waits for all (killing them after ``timeout`` s)."""
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="tutel-dist-") as directory:
        running = [_start(name, argv, envs[name], directory) for name, argv in commands.items()]
        timed_out = _wait_all(running, timeout)
        outputs = _collect(running, timed_out)
    return LaunchResult(outputs, time.monotonic() - start, timed_out, what)


# What the C++ runtime prints when a process aborts because a thread object is destroyed while its
# thread still runs: seen, rarely and under load, in a torchrun worker of PyTorch 2.15 with gloo as
# it exits after its work (PyTorch's process-group teardown, no thread of tutel's).
_TEARDOWN_ABORT = "terminate called without an active exception"


def run_command(argv: Sequence[str], env: Optional[Dict[str, Optional[str]]] = None,
                timeout: float = 120, attempts: int = 2) -> ProcessOutput:
    """Runs one command line (e.g. torchrun or mpiexec) in a clean environment; see ``launch``.

    A command that fails with PyTorch's teardown abort (_TEARDOWN_ABORT) is run again, up to
    ``attempts`` runs in all; any other failure, or the abort in every run, is returned as it is.
    """
    for attempt in range(1, attempts + 1):
        result = run_processes({"command": argv}, {"command": clean_environment(env)}, timeout, " ".join(argv))
        output = result.ranks[0]
        if result.timed_out:
            raise AssertionError(f"`{' '.join(argv)}` timed out after {timeout} s\n{output.describe()}")
        if output.returncode == 0 or _TEARDOWN_ABORT not in output.stderr or attempt == attempts:
            return output
        print(f"`{' '.join(argv)}` aborted in PyTorch's teardown; running it again:\n{output.describe()}",
              file=sys.stderr)
    raise AssertionError("unreachable")


def _port_was_taken(output: ProcessOutput) -> bool:
    return any(marker in output.stderr or marker in output.stdout for marker in _PORT_TAKEN)


def run_command_on_a_free_port(make_command: Callable[[int], Tuple[Sequence[str], Dict[str, Optional[str]]]],
                               timeout: float = 120, attempts: int = 3) -> ProcessOutput:
    """Runs ``run_command(*make_command(port))`` with a port free at the time; when another program
    took the port before the command bound it, runs it again on a new port (a free port can only
    be chosen before it is bound, so the race is retried, not prevented)."""
    for attempt in range(1, attempts + 1):
        argv, env = make_command(free_port())
        output = run_command(argv, env, timeout)
        if not _port_was_taken(output) or attempt == attempts:
            return output
    raise AssertionError("unreachable")


def launch(target: str, world_size: int, env: Optional[Dict[str, Optional[str]]] = None,
           args: Sequence[str] = (), timeout: float = 120, attempts: int = 3) -> LaunchResult:
    """Runs ``target`` ("module:function") in ``world_size`` processes; see the module docstring."""
    for attempt in range(1, attempts + 1):
        port = free_port()
        commands, envs = {}, {}
        for rank in range(world_size):
            name = f"rank {rank}"
            commands[name] = [sys.executable, os.path.join(HERE, "dist_harness.py"), target, *map(str, args)]
            envs[name] = clean_environment({
                "RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
                "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                **(env or {})})
        result = run_processes(commands, envs, timeout, f"{target} on {world_size} processes")
        result.attempts = attempt
        if not _port_was_taken(result.ranks[0]) or attempt == attempts:
            return result
    raise AssertionError("unreachable")


def init_gloo(group_count: int = 1):
    """Joins the process group of a launch with gloo (tutel.system.init_data_model_parallel)."""
    from tutel import system
    return system.init_data_model_parallel(group_count=group_count, backend="gloo")


def _worker_main(argv: List[str]) -> None:
    target, args = argv[0], argv[1:]
    module_name, function_name = target.split(":")
    for path in (HERE, REPO_ROOT):
        if path not in sys.path:
            sys.path.insert(0, path)
    status = 0
    try:
        getattr(importlib.import_module(module_name), function_name)(*args)
    except BaseException:  # report anything, then leave at once so that the peers fail fast
        traceback.print_exc()
        status = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


if __name__ == "__main__":
    _worker_main(sys.argv[1:])
