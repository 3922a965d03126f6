"""The scripts of benchmarks/ as the tests load them, and a stand-in for their device clock."""
import importlib.util
import os
import sys
import types
from typing import Optional

BENCHMARKS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                              "benchmarks")


def load_script(name: str, module_name: Optional[str] = None) -> types.ModuleType:
    """benchmarks/<name>.py loaded as a fresh module (named `module_name`, default
    tutel_benchmark_<name>), with benchmarks/ on sys.path for its own imports."""
    if BENCHMARKS_DIR not in sys.path:
        sys.path.insert(0, BENCHMARKS_DIR)
    spec = importlib.util.spec_from_file_location(module_name or f"tutel_benchmark_{name}",
                                                  os.path.join(BENCHMARKS_DIR, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class FakeClock:
    """Device events on a clock that each candidate advances by its own cost when it runs."""

    def __init__(self):
        self.now = 0.0

    def event(self):
        """A stand-in for torch.cuda.Event(enable_timing=True) on this clock."""
        clock = self

        class Event:
            def record(self):
                self.at = clock.now

            def synchronize(self):
                pass

            def elapsed_time(self, end):
                return end.at - self.at
        return Event()
