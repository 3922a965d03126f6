"""Fixtures of the DeepSpeed integration tests.

DeepSpeed is imported lazily (only by the fixtures that need it), so the call
sequence tests in this folder run without DeepSpeed installed.
"""
import os
from collections import defaultdict
from datetime import timedelta

import pytest
import torch

# Largest |use_tutel=True - use_tutel=False| per dtype, and how many values were compared.
_largest_difference = defaultdict(float)
_compared_values = defaultdict(int)


@pytest.fixture(scope="session")
def deepspeed_world(tmp_path_factory):
    """A one-process gloo world set up the way DeepSpeed programs do (deepspeed.init_distributed).

    DeepSpeed releases before 0.19 run their all-to-all even for ep_size=1, so the
    MoE layer needs deepspeed.comm initialised.  The process group meets in a file, not
    on a TCP port (no port to race for); deepspeed.init_distributed then adopts it.
    """
    import deepspeed

    for name, value in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1").items():
        os.environ.setdefault(name, value)
    rendezvous = tmp_path_factory.mktemp("deepspeed_world") / "rendezvous"
    torch.distributed.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=0, world_size=1,
                                         timeout=timedelta(seconds=120))
    deepspeed.init_distributed(dist_backend="gloo", timeout=timedelta(seconds=120))
    yield deepspeed
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


@pytest.fixture
def record_difference():
    """record(dtype, actual, expected): notes the largest absolute difference for the summary."""

    def record(dtype: torch.dtype, actual: torch.Tensor, expected: torch.Tensor) -> None:
        difference = (actual.detach().double() - expected.detach().double()).abs()
        largest = float(difference.max()) if difference.numel() else 0.0
        _largest_difference[dtype] = max(_largest_difference[dtype], largest)
        _compared_values[dtype] += difference.numel()

    return record


def pytest_terminal_summary(terminalreporter):
    if not _compared_values:
        return
    try:
        import deepspeed
        version = deepspeed.__version__
    except ImportError:
        version = "not installed"
    terminalreporter.write_sep("-", f"DeepSpeed {version}: use_tutel=True vs use_tutel=False")
    for dtype in sorted(_compared_values, key=str):
        terminalreporter.write_line(
            f"{str(dtype).replace('torch.', '')}: max |difference| = {_largest_difference[dtype]:.3g} "
            f"over {_compared_values[dtype]} values (outputs, l_aux, input / gate / expert gradients)")
