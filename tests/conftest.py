"""Suite-wide settings.

The suite runs multi-rank jobs (2 trainer + 2 inference ranks, say) on 2-core CI machines on
purpose: MESHRL_ALLOW_OVERSUBSCRIBE=1 lets them start there (runtime/launch.py's core guard); the
test of that guard removes it.
"""

import os

import pytest

os.environ.setdefault("MESHRL_ALLOW_OVERSUBSCRIBE", "1")


@pytest.fixture
def one_thread():
    """One torch thread for the test (tiny matmuls: a second OpenMP thread only adds waits, seconds
    per test on a loaded 2-core box); the count is restored after."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
