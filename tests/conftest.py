"""Suite-wide settings.

The suite runs multi-rank jobs (2 trainer + 2 inference ranks, say) on 2-core CI machines on
purpose: MESHRL_ALLOW_OVERSUBSCRIBE=1 lets them start there (runtime/launch.py's core guard); the
test of that guard removes it.

The tests in this process compute with one torch thread (tests/dist's ranks too: multirank.py). Their
models are tiny: a second OpenMP thread only adds waits, and on a loaded 2-core machine a descheduled
thread stalls every parallel op (measured: the engine's scheduler and preemption tests took 216 s with
two threads, 26 s with one, back to back at load 7-9). The jobs the tests start set their own threads
(launch.threads_per_rank).
"""

import os

import torch

os.environ.setdefault("MESHRL_ALLOW_OVERSUBSCRIBE", "1")
torch.set_num_threads(1)
