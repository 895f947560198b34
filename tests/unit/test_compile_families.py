"""torch.compile per block, under selective activation checkpointing, for every native MoE family:
compiled logprobs and gradients equal eager (one process, FSDP2 over a gloo world of one).

On CPU the experts run as a loop over `counts.tolist()`, a data-dependent split that dynamo
traces as unbacked ints (parallel/parallelize.py sets capture_scalar_outputs): no graph break,
which under activation checkpointing would have run every MoE block eagerly.

Inductor compiles C++ on CPU, ~40-60 s per family on a 2-core machine. The default run compiles
glm4_moe with inductor and deepseek_v3 (MLA) with the `aot_eager` backend: dynamo's trace and AOT
autograd's joint graph, where a family's own code breaks (graph breaks, unbacked ints,
functionalisation), without inductor's code generation (~10 s). The heavy tier (`pytest -m heavy`)
compiles every family with inductor, and qwen3_next with aot_eager (~30 s). Skipped without a
C++ compiler.
"""

import os
import shutil

import pytest
import torch
import torch.distributed as dist

from meshrl.models import get_family
from meshrl.models.common.attention import DocumentCausalAttention
from meshrl.parallel import parallelize
from meshrl.parallel.dims import ParallelDims, build_meshes
from meshrl.runtime.train.logprob_head import LogprobHead
from tests.dist.multirank import free_port
from tests.family_checks import build_random

ALL_FAMILIES = ["glm4_moe", "minimax_m2", "deepseek_v3", "gpt_oss", "glm_moe_dsa", "qwen3_next"]
# (family, backend): inductor for glm4_moe by default and for the others in the heavy tier (qwen3_next:
# inductor over the chunked delta rule takes many minutes on a 2-core CPU); aot_eager for the two
# families whose attention is their own (MLA by default, linear attention in the heavy tier)
CASES = [pytest.param(f, "inductor", marks=() if f == "glm4_moe" else pytest.mark.heavy, id=f"{f}-inductor")
         for f in ALL_FAMILIES] + [pytest.param("deepseek_v3", "aot_eager", id="deepseek_v3-aot_eager"),
                            pytest.param("qwen3_next", "aot_eager", id="qwen3_next-aot_eager", marks=pytest.mark.heavy)]


def _run(family: str, compile: bool):
    fam = get_family(family)
    model = build_random(fam.model_cls, fam.flavors["debug"])
    meshes = build_meshes(ParallelDims.resolve(1), [0], 0, "cpu")
    parallelize(model, meshes, torch.float32, ac="selective", compile=compile)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, fam.flavors["debug"].vocab_size, (1, 64), generator=gen)
    positions = torch.cat([torch.arange(40), torch.arange(24)])[None]
    doc_ids = torch.cat([torch.zeros(40), torch.ones(24)]).long()[None]
    logprobs = []
    for _ in range(2):  # the second call reuses the compiled graphs
        lp, _ = model(ids, positions, DocumentCausalAttention(doc_ids), head=LogprobHead(torch.roll(ids, -1, 1), 0.7))
        lp.sum().backward()
        logprobs.append(lp.detach())
    return logprobs, {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None, reason="inductor needs a C++ compiler")
@pytest.mark.parametrize(("family", "backend"), CASES)
def test_compiled_moe_blocks_match_eager(family, backend, monkeypatch):
    from torch._dynamo.utils import counters

    if backend != "inductor":  # what apply_compile's `block.compile()` calls, with the backend set
        original = torch.nn.Module.compile
        monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kw: original(self, backend=backend, **kw))
    for key, value in dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1").items():
        monkeypatch.setenv(key, value)  # not left behind for later tests (the CLI reads WORLD_SIZE)
    dist.init_process_group("gloo")
    try:
        counters.clear()
        eager, eager_grads = _run(family, compile=False)
        compiled, compiled_grads = _run(family, compile=True)
        breaks = dict(counters["graph_break"])
        assert not breaks, breaks
        if backend == "inductor":
            assert counters["inductor"]["fxgraph_cache_miss"] + counters["inductor"].get("fxgraph_cache_hit", 0) > 0
        else:
            assert counters["aot_autograd"]["total"] > 0  # the blocks did go through AOT autograd
        for a, b in zip(eager, compiled):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
        assert compiled_grads.keys() == eager_grads.keys()
        for name, grad in eager_grads.items():
            torch.testing.assert_close(compiled_grads[name], grad, rtol=1e-4, atol=1e-5, msg=name)
    finally:
        dist.destroy_process_group()
