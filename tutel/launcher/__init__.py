"""Launchers: ``mpiexec ... python3 -m tutel.launcher.run [-m] <module or script> args``."""
import os
import sys
from typing import List


def exec_command(command: List[str]) -> None:
    """Replaces this process with ``command`` (flushing stdout first)."""
    sys.stdout.flush()
    os.execv(command[0], command)
