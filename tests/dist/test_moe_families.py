"""Every native MoE family: one RL step of the real Trainer with expert parallelism (EP 2 over
FSDP 2, full or selective activation checkpointing, with and without torch.compile) equals the
single-process (EP 1) step, on 2 gloo ranks; so does context parallelism (cp 2, families without
linear attention). A hub-layout
folder loads straight into FSDP2 + EP shards.

Same harness as test_parallel_trainer.py: loss statistics and every updated parameter must match
the reference within fp32 round-off, and the step must move every trainable parameter (frozen
ones, such as the score-correction bias, must stay as they were, also under EP and FSDP2).
"""

import random

import pytest
import torch

from meshrl.models import get_family
from meshrl.parallel import full_tensors, parallelize
from meshrl.parallel.dims import ParallelDims, build_meshes
from meshrl.runtime.config import LossConfig, OptimConfig
from meshrl.runtime.train.packing import Sample, count_loss_tokens, pack
from meshrl.runtime.train.trainer import Trainer
from tests.dist.multirank import run_ranks
from tests.family_checks import build_random

OPTIM = OptimConfig(lr=1e-2, weight_decay=0.01, eps=1e-4)  # eps: see test_parallel_trainer.py
LOSS = LossConfig(kl_coef=0.1)
SEQ_LEN = 96
FAMILIES = ["glm4_moe", "minimax_m2", "deepseek_v3", "gpt_oss", "glm_moe_dsa", "qwen3_next", "qwen3_5_moe"]
# Linear-attention families refuse context parallelism (before launch: tests/unit/test_qwen3_next.py).
CP_FAMILIES = [f for f in FAMILIES if "no_cp" not in get_family(f).parallel_plan]
# What the default run (CI, 2 cores) keeps; everything else runs with `-m heavy`. The default keeps
# deepseek_v3, whose MoE (sigmoid router, correction bias, grouped top-k, shared experts) is
# glm4_moe's and glm_moe_dsa's and whose MLA is their attention too; the end-to-end EP RL jobs of
# gpt_oss and qwen3_next (tests/integration/test_moe_families_rl.py) run by default as well.
# The linear-attention families' EP step runs ~5 minutes on a 2-core CPU (the chunked delta rule).
AC_VARIANTS = [("full", False, "full-ac"), ("selective", False, "selective-ac"),
               ("selective", True, "selective-ac-compile")]  # compile: ~2.5 min, both ranks run inductor
EP_CASES = [pytest.param(f, ac, compile, id=f"{f}-{name}",
                         marks=() if (f, name) == ("deepseek_v3", "full-ac") else pytest.mark.heavy)
            for f in FAMILIES for ac, compile, name in AC_VARIANTS]
# hub folder -> FSDP + EP shards: one per key-map kind runs by default (MLA + per-expert keys)
HUB_FAMILIES = [f if f == "deepseek_v3" else pytest.param(f, marks=pytest.mark.heavy) for f in FAMILIES]


def make_model(family: str):
    fam = get_family(family)
    # Decisive routing: the EP and single-process runs sum in different orders, and near-tied
    # top-k choices must not flip on that round-off.
    return build_random(fam.model_cls, fam.flavors["debug"])


def make_samples(vocab: int) -> list[Sample]:
    rng = random.Random(0)
    samples = []
    for _ in range(14):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(3, 12))]
        completion = [rng.randrange(3, vocab) for _ in range(rng.randint(2, 30))]
        logprobs = [-4.85 + rng.uniform(-0.3, 0.3) for _ in completion]
        samples.append(Sample(prompt, completion, logprobs, advantage=rng.uniform(-1, 1)))
    return samples


def _step(model, family: str, group, meshes, num_data_ranks: int, data_rank: int):
    trainer = Trainer(model, OPTIM, torch.device("cpu"), group, meshes)
    batches = pack(make_samples(get_family(family).flavors["debug"].vocab_size), SEQ_LEN, num_data_ranks)
    return trainer.rl_step(batches[data_rank], count_loss_tokens(batches), LOSS, temperature=0.7)


def _job(rank, world_size, family, ac, compile, out, cp=1):
    dims = (ParallelDims.resolve(world_size, dp_shard=world_size, ep=world_size) if cp == 1 else
            ParallelDims.resolve(world_size, dp_shard=world_size // cp, cp=cp))
    meshes = build_meshes(dims, list(range(world_size)), rank, "cpu")
    model = parallelize(make_model(family), meshes, torch.float32, ac=ac, compile=compile)
    stats = _step(model, family, torch.distributed.group.WORLD, meshes, dims.num_data_ranks, dims.data_rank(rank))
    full = {k: v.clone() for k, v in full_tensors(model)}
    if rank == 0:
        torch.save({"params": full, "stats": stats}, out / "trainer.pt")


@pytest.mark.parametrize("family, ac, compile", EP_CASES)
def test_expert_parallel_step_equals_single_process(tmp_path, family, ac, compile):
    run_ranks(_job, 2, family, ac, compile, tmp_path)
    got = torch.load(tmp_path / "trainer.pt")
    model = make_model(family)
    init = {k: p.detach().clone() for k, p in model.named_parameters()}
    ref_stats = _step(model, family, None, None, 1, 0)
    assert got["params"].keys() == init.keys()
    for name, param in model.named_parameters():
        moved = not torch.equal(param.detach(), init[name])
        assert moved == param.requires_grad, f"{name}: moved={moved}, requires_grad={param.requires_grad}"
        torch.testing.assert_close(got["params"][name], param.detach(), rtol=1e-5, atol=2e-6, msg=name)
    for key in ("loss", "mismatch_kl", "entropy", "grad_norm", "loss_tokens"):
        assert abs(got["stats"][key] - ref_stats[key]) <= 1e-5 * max(1.0, abs(ref_stats[key])), key
    assert got["stats"]["moe/load_max"] >= 1.0 >= got["stats"]["moe/load_min"] >= 0.0


@pytest.mark.parametrize("family", [f if f == "deepseek_v3" else pytest.param(f, marks=pytest.mark.heavy)
                                    for f in CP_FAMILIES])
def test_context_parallel_step_equals_single_process(tmp_path, family):
    """cp 2: each packed row split over two ranks (MLA's narrower v included)."""
    run_ranks(_job, 2, family, "none", False, tmp_path, 2)
    got = torch.load(tmp_path / "trainer.pt")
    model = make_model(family)
    ref_stats = _step(model, family, None, None, 1, 0)
    for name, param in model.named_parameters():
        torch.testing.assert_close(got["params"][name], param.detach(), rtol=1e-5, atol=2e-6, msg=name)
    for key in ("loss", "mismatch_kl", "entropy", "grad_norm", "loss_tokens"):
        assert abs(got["stats"][key] - ref_stats[key]) <= 1e-5 * max(1.0, abs(ref_stats[key])), key


def _load_job(rank, world_size, folder, out):
    from meshrl.runtime.config import ModelConfig
    from meshrl.runtime.policy import build_trainer_policy

    dims = ParallelDims.resolve(world_size, dp_shard=world_size, ep=world_size)
    meshes = build_meshes(dims, list(range(world_size)), rank, "cpu")
    model, _ = build_trainer_policy(ModelConfig(path=str(folder)), torch.device("cpu"),
                                    lambda m: parallelize(m, meshes, torch.float32))
    full = {k: v.clone() for k, v in full_tensors(model)}
    if rank == 0:
        torch.save(full, out / "full.pt")


@pytest.mark.parametrize("family", HUB_FAMILIES)
def test_hub_folder_loads_into_fsdp_and_expert_shards(tmp_path, family):
    """The folder transformers writes (hub layout) read straight into FSDP2 + EP 2 shards, each
    rank its own pieces, equals the one-process load bit for bit once gathered."""
    import transformers

    from meshrl.models.hf import load_hf_model, save_hf_model

    fam = get_family(family)
    args = fam.flavors["debug"]
    save_hf_model(make_model(family), args, tmp_path / "ours")
    transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours", dtype=torch.float32).save_pretrained(
        tmp_path / "hub")
    run_ranks(_load_job, 2, tmp_path / "hub", tmp_path)
    got = torch.load(tmp_path / "full.pt")
    ref = dict(load_hf_model(tmp_path / "hub")[0].named_parameters())
    assert got.keys() == ref.keys()
    for name, value in ref.items():
        assert torch.equal(got[name], value.detach()), name
