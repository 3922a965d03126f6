"""Shared by the transformers integration tests (imported by each, not a conftest.py: the tests
one directory up import names from their own ``conftest`` module, which a second conftest.py
would shadow).

The tests run tiny models: one intra-op thread, so their many small operations do not pay the
thread pool's synchronisation (which dominates at these sizes, and more so when other work
shares the cores).

They run against every supported transformers release CI tests (the newest in the main run, the
oldest in tests/integration/transformers/run.sh); a test model that the installed release lacks
is skipped there with the reason "not in transformers X" (``skip_unless_released``)."""
import os

import pytest
import torch

if os.environ.get("CI") == "true":
    # CI installs transformers (tests/setup_env.sh): there a missing one is an error, not a skip.
    import transformers  # noqa: F401

# Test models (families and experts cases, declared with @use_experts_implementation) and model
# features newer than the oldest supported release: the first release that has them.
FIRST_RELEASE = {
    "deepseek_v4": "5.8.0",
    "cohere2_moe": "5.9.0",
    "granitemoe": "5.13.0",
    "granitemoeshared": "5.13.0",
    "aria": "5.18.0",
    "muse_spark": "5.20.0",
    "deepseek_v3.router_logits": "5.19.0",  # output_router_logits of DeepSeek-V3 models
}


def skip_unless_released(name: str) -> None:
    """Skips the calling test where the installed transformers predates the test model `name`."""
    first = FIRST_RELEASE.get(name)
    if first is None:
        return
    import transformers
    from packaging.version import Version
    if Version(transformers.__version__) < Version(first):
        pytest.skip(f"not in transformers {transformers.__version__}: {name} (since {first})")


@pytest.fixture(autouse=True)
def one_intra_op_thread():
    """Autouse in every module that imports it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
