"""Tensor-parallel NativeEngine (parallel/tensor_parallel.py) against the single-process engine.

Two gloo ranks hold one replica of a tiny fp32 Qwen3 and Llama 3: greedy tokens must equal the
one-process engine's exactly and logprobs agree to 1e-5 (only the order of the all-reduced sums
differs), for mixed prompt lengths, n > 1 with seeds, shared prefixes, chunked prefill and
preemption. A weight update through weight_sync's slice path must equal loading the full
weights into the one-process engine. Plus the ValueErrors of models that cannot be split.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from meshrl.models.llama3 import Llama3, Llama3Args
from meshrl.models.qwen3 import Qwen3, Qwen3Args
from meshrl.models.qwen3_moe import FLAVORS as MOE_FLAVORS
from meshrl.models.qwen3_moe import Qwen3Moe
from meshrl.parallel.tensor_parallel import (ColwiseLinear, RowwiseLinear, check_tensor_parallel, full_shape,
                                             local_slice, shard_for_inference)
from meshrl.runtime import weight_sync
from meshrl.runtime.engine.api import Completion, Request, SamplingParams
from meshrl.runtime.engine.native import NativeEngine
from tests.dist.multirank import run_ranks
from tests.random_models import scaled_random_model

VOCAB = 96
FAMILIES = {
    "qwen3": (Qwen3, Qwen3Args(vocab_size=VOCAB, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                               hidden_dim=128, tie_embeddings=True)),
    "llama": (Llama3, Llama3Args(vocab_size=VOCAB, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=96,
                                 tie_embeddings=False)),
}
BUCKET_MB = 0.01  # several buckets even for the tiny model


def make_model(family: str, seed: int = 0) -> nn.Module:
    """A random fp32 model of the family, matrices scaled 8x (tests/random_models.py)."""
    cls, args = FAMILIES[family]
    return scaled_random_model(cls, args, seed)


def make_engine(model: nn.Module, tp_group=None, **kwargs) -> NativeEngine:
    kwargs.setdefault("max_num_seqs", 4)
    kwargs.setdefault("block_size", 4)
    return NativeEngine(model, max_model_len=64, device="cpu", dtype=torch.float32, tp_group=tp_group, **kwargs)


def prompts(lengths: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


def scenario() -> list[Request]:
    """Mixed lengths (greedy), a prompt extending another (shared full blocks), an exact duplicate
    queued next to it (prefill once, fork), n = 3 seeded samples, and seeded temperature rows."""
    base = prompts([13, 3, 5, 1, 9, 21], seed=0)
    greedy = [Request(i, p, SamplingParams(temperature=0.0, max_tokens=6 + i)) for i, p in enumerate(base)]
    shared = [Request(10, base[0] + [7, 8, 9], SamplingParams(temperature=0.0, max_tokens=8)),
              Request(11, list(base[0]), SamplingParams(temperature=0.0, max_tokens=10))]
    sampled = [Request(20, base[4], SamplingParams(temperature=0.8, max_tokens=12, n=3, seed=5)),
               Request(21, base[2], SamplingParams(temperature=1.0, max_tokens=9, seed=17))]
    return greedy + shared + sampled


def run(engine: NativeEngine, requests: list[Request], swap=None) -> list[Completion]:
    """Run to completion; `swap(engine)` is called after the third step (an in-flight weight update)."""
    for r in requests:
        engine.add(Request(r.request_id, list(r.prompt_ids), r.sampling))
    done, steps = [], 0
    while engine.has_work():
        done += engine.step()
        engine.check()
        steps += 1
        if steps == 3 and swap is not None:
            swap(engine)
            engine.set_version(1)
    return sorted(done, key=lambda c: (c.request_id, c.index))


def as_rows(completions: list[Completion]) -> list[tuple]:
    return [(c.request_id, c.index, c.token_ids, c.logprobs, c.versions, c.finish_reason) for c in completions]


ENGINE_SETTINGS = {
    "default": {},
    "chunked": dict(max_num_batched_tokens=8),  # prompts prefilled in chunks over several steps
    "preempt": dict(num_blocks=17),  # a cache small enough that running sequences are preempted
}


def _engine_job(rank, world_size, out):
    group = dist.new_group([0, 1])
    for family in FAMILIES:
        model = shard_for_inference(make_model(family), group)
        wq = model.layers["0"].attention.wq
        assert isinstance(wq, ColwiseLinear) and isinstance(model.layers["0"].feed_forward.w2, RowwiseLinear)
        assert wq.weight.shape == (2 * 16, 64)  # 2 of the 4 query heads
        for name, settings in ENGINE_SETTINGS.items():
            engine = make_engine(model, group, **settings)
            assert engine.kv.data.shape[2] == 1  # the cache holds this rank's 1 of the 2 kv heads
            torch.save(as_rows(run(engine, scenario())), out / f"{family}-{name}-rank{rank}.pt")


def reference(family: str, settings: dict, swap=None) -> list[tuple]:
    return as_rows(run(make_engine(make_model(family), **settings), scenario(), swap))


def assert_same(got: list[tuple], ref: list[tuple], what: str) -> None:
    assert len(got) == len(ref), what
    for g, r in zip(got, ref):
        assert g[0:2] == r[0:2] and g[4:] == r[4:], (what, g[0:2])
        assert g[2] == r[2], f"{what}: request {g[0]} sample {g[1]} tokens differ: {g[2]} vs {r[2]}"
        assert g[3] == pytest.approx(r[3], abs=1e-5), f"{what}: request {g[0]} logprobs"


@pytest.mark.heavy  # ~25 s on 2 cores; TP's on-policy RL job (tests/integration/test_tp_rl.py) runs by default
def test_tp_engine_equals_single_process_engine(tmp_path):
    run_ranks(_engine_job, 2, tmp_path)
    for family in FAMILIES:
        for name, settings in ENGINE_SETTINGS.items():
            ranks = [torch.load(tmp_path / f"{family}-{name}-rank{r}.pt") for r in range(2)]
            assert ranks[0] == ranks[1], "the ranks of a replica must produce identical completions"
            ref = reference(family, settings)
            assert any(len(set(row[2])) > 2 for row in ref), "vacuous: the model only repeats tokens"
            assert_same(ranks[0], ref, f"{family}/{name}")


def _sync_job(rank, world_size, out):
    # ranks 0, 1: one tensor-parallel replica; rank 2 plays trainer rank 0 and sends full weights
    tp_group = dist.new_group([0, 1])
    sync_group = dist.new_group([2, 0, 1])
    for family in FAMILIES:
        new = make_model(family, seed=1)
        if rank == 2:
            weight_sync.send_weights(new, sync_group, 2, torch.float32, BUCKET_MB, torch.device("cpu"))
            continue
        model = shard_for_inference(make_model(family), tp_group)
        engine = make_engine(model, tp_group)
        full = dict(new.named_parameters())
        assert [n for n, _ in model.named_parameters()] == list(full), "sharding must keep parameter names"
        for name, p in model.named_parameters():
            assert full_shape(model, name, p) == full[name].shape

        def swap(engine):
            weight_sync.receive_weights(engine.model, sync_group, 2, torch.float32, BUCKET_MB, torch.device("cpu"))
            for name, p in engine.model.named_parameters():  # exactly this rank's slice of the full tensor
                assert torch.equal(p, local_slice(engine.model, name, full[name].detach())), name

        torch.save(as_rows(run(engine, scenario(), swap)), out / f"{family}-rank{rank}.pt")


@pytest.mark.heavy
def test_weight_update_through_tp_slices_equals_full_load(tmp_path):
    run_ranks(_sync_job, 3, tmp_path)
    for family in FAMILIES:
        new = make_model(family, seed=1)

        def swap(engine):
            with torch.no_grad():
                for p, q in zip(engine.model.parameters(), new.parameters()):
                    p.copy_(q)

        ref = reference(family, {}, swap)
        assert any(1 in row[4] for row in ref) and any(0 in row[4] for row in ref), "the update must be in flight"
        got = torch.load(tmp_path / f"{family}-rank0.pt")
        assert got == torch.load(tmp_path / f"{family}-rank1.pt")
        assert_same(got, ref, f"{family} after a weight update")


# ------------------------------------------------------------------------------- GPU


def _cuda_job(rank, world_size, out):
    group = dist.group.WORLD  # "cpu:gloo,cuda:nccl": the model's all-reduces and the sample broadcast on NCCL
    model = shard_for_inference(make_model("qwen3"), group)
    engine = NativeEngine(model, max_num_seqs=8, max_model_len=64, device="cuda", dtype=torch.bfloat16,
                          cuda_graphs=True, tp_group=group)
    greedy = [Request(r.request_id, r.prompt_ids, SamplingParams(temperature=0.0, max_tokens=r.sampling.max_tokens))
              for r in scenario()]
    done = run(engine, greedy)
    assert engine.runner.graphs, "no graph was captured"
    torch.save(as_rows(done), out / f"cuda-rank{rank}.pt")


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_cuda_tp_engine_with_nccl_and_graphs_equals_one_gpu_up_to_ties(tmp_path):
    """bf16, NCCL all-reduces captured in the decode graphs: the TP=2 engine's greedy tokens equal
    the one-GPU engine's until a position where the two logits are within bf16 rounding of a tie
    (a free-running greedy sequence follows its own choice from there, so the rest is not compared)."""
    run_ranks(_cuda_job, 2, tmp_path, backend="cpu:gloo,cuda:nccl")
    got = torch.load(tmp_path / "cuda-rank0.pt")
    assert got == torch.load(tmp_path / "cuda-rank1.pt")
    model = make_model("qwen3")
    engine = NativeEngine(model, max_num_seqs=8, max_model_len=64, device="cuda", dtype=torch.bfloat16,
                          cuda_graphs=True)
    greedy = [Request(r.request_id, r.prompt_ids, SamplingParams(temperature=0.0, max_tokens=r.sampling.max_tokens))
              for r in scenario()]
    ref = as_rows(run(engine, greedy))
    prompts = {r.request_id: r.prompt_ids for r in greedy}
    ties = 0
    for g, r in zip(got, ref):
        assert g[0:2] == r[0:2]
        first = next((i for i, (a, b) in enumerate(zip(g[2], r[2])) if a != b), None)
        if first is None:
            assert g[2] == r[2]
            continue
        ids = prompts[g[0]] + r[2][:first]
        with torch.no_grad():
            logits = engine.model(torch.tensor([ids], device="cuda"), torch.arange(len(ids), device="cuda")[None])
        logits = logits[0, -1].float()  # (V,): the position where the two engines chose differently
        gap = (logits[r[2][first]] - logits[g[2][first]]).abs().item()
        assert gap <= 0.02 * logits.abs().max().item() + 1e-3, (g[0], first, gap)
        ties += 1
    assert ties <= len(got) // 2, f"{ties} of {len(got)} sequences diverged: more than near-ties explain"


# ------------------------------------------------------------------------------- errors


def test_heads_kv_heads_and_ffn_width_must_divide():
    with torch.device("meta"):
        model = Qwen3(Qwen3Args(n_heads=6, n_kv_heads=2, head_dim=16, hidden_dim=128))
    with pytest.raises(ValueError, match=r"tensor_parallel = 4 must divide the qwen3 model's attention heads \(6\)"):
        check_tensor_parallel(model, 4)
    with torch.device("meta"):
        model = Llama3(Llama3Args(dim=64, n_heads=8, n_kv_heads=2, hidden_dim=128))
    with pytest.raises(ValueError, match=r"kv heads \(2\)"):
        check_tensor_parallel(model, 4)
    with torch.device("meta"):
        model = Qwen3(Qwen3Args(n_heads=4, n_kv_heads=4, head_dim=16, hidden_dim=130))
    with pytest.raises(ValueError, match=r"FFN width \(hidden_dim\) \(130\)"):
        check_tensor_parallel(model, 4)
    with torch.device("meta"):
        model = Qwen3(Qwen3Args(n_heads=4, n_kv_heads=2, head_dim=16, hidden_dim=128))
    plan = check_tensor_parallel(model, 2)
    assert plan["layers.1.attention.wo"] == "rowwise" and plan["layers.0.feed_forward.w3"] == "colwise"
    assert len(plan) == 2 * 7


def test_families_without_a_tp_plan_are_refused():
    with torch.device("meta"):
        moe = Qwen3Moe(MOE_FLAVORS["debug"])
    with pytest.raises(ValueError, match="qwen3_moe model has no tensor-parallel plan"):
        check_tensor_parallel(moe, 2)
    with pytest.raises(ValueError, match="Linear model has no tensor-parallel plan"):
        check_tensor_parallel(nn.Linear(4, 4), 2)
