"""Suite-wide settings.

The suite runs multi-rank jobs (2 trainer + 2 inference ranks, say) on 2-core CI machines on
purpose: MESHRL_ALLOW_OVERSUBSCRIBE=1 lets them start there (runtime/launch.py's core guard); the
test of that guard removes it.

The tests in this process compute with one torch thread (tests/dist's ranks too: multirank.py). Their
models are tiny: a second OpenMP thread only adds waits, and on a loaded 2-core machine a descheduled
thread stalls every parallel op (measured: the engine's scheduler and preemption tests took 216 s with
two threads, 26 s with one, back to back at load 7-9). The jobs the tests start get OMP_NUM_THREADS=1
as well (launch.threads_per_rank honours it; a test of that default removes it), for the same reason:
the reverse-text SFT warm start, a job of one rank that would take both cores, took 25.8 s with two
threads and 15.6 s with one at load ~2.7, and 166 s with two at load 4-6 (the same final loss;
docs/benchmarks.md).
"""

import os

import torch

os.environ.setdefault("MESHRL_ALLOW_OVERSUBSCRIBE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)
