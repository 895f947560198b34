"""Suite-wide settings.

The suite runs multi-rank jobs (2 trainer + 2 inference ranks, say) on 2-core CI machines on
purpose: MESHRL_ALLOW_OVERSUBSCRIBE=1 lets them start there (runtime/launch.py's core guard); the
test of that guard removes it.
"""

import os

import pytest

os.environ.setdefault("MESHRL_ALLOW_OVERSUBSCRIBE", "1")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """tests/dist (gloo multi-rank jobs against a single process) is in the heavy tier for now:
    pytest's default norecursedirs had left it out of every default run, and its cost on the 2-core
    CI machine is not measured yet. `pytest -m heavy` (or `pytest tests/dist -m ''`) runs it."""
    for item in items:
        if "/tests/dist/" in str(item.path):
            item.add_marker(pytest.mark.heavy)
