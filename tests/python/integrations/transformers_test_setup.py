"""Shared by the transformers integration tests (imported by each, not a conftest.py: the tests
one directory up import names from their own ``conftest`` module, which a second conftest.py
would shadow).

The tests run tiny models: one intra-op thread, so their many small operations do not pay the
thread pool's synchronisation (which dominates at these sizes, and more so when other work
shares the cores)."""
import os

import pytest
import torch

if os.environ.get("CI") == "true":
    # CI installs transformers (tests/setup_env.sh): there a missing one is an error, not a skip.
    import transformers  # noqa: F401


@pytest.fixture(autouse=True)
def one_intra_op_thread():
    """Autouse in every module that imports it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
