"""The integration tests run tiny models: one intra-op thread, so their many small operations do
not pay the thread pool's synchronisation (which dominates at these sizes, and more so when other
work shares the cores)."""
import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
