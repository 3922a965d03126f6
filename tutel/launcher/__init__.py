"""Launchers: ``mpiexec ... python3 -m tutel.launcher.run [-m] <module or script> args``."""
