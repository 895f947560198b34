"""One RL step of the real Trainer under each parallel layout equals the single-process step.

Real processes on gloo: HSDP (dp_replicate 2 x dp_shard 2), FSDP x context parallel
(dp_shard 2 x cp 2) with selective activation checkpointing, FSDP over 2 ranks with full
activation checkpointing on every other block, and Qwen3-MoE with expert parallelism (ep 2,
plain and under HSDP). Updated parameters and the step statistics
must match the reference within fp32 round-off; the step must actually move every parameter.
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

ARGS = get_family("qwen3").flavors["debug"]
# eps = 1e-4 keeps Adam's first step Lipschitz in the gradient (at most lr / eps = 100x): with
# the usual 1e-8, an element whose gradient is ~1e-8 moves by a large fraction of lr on float
# round-off alone, and the step would only compare gradient signs.
OPTIM = OptimConfig(lr=1e-2, weight_decay=0.01, eps=1e-4)
LOSS = LossConfig(kl_coef=0.1)
SEQ_LEN = 96


def make_model(family: str = "qwen3"):
    fam = get_family(family)
    with torch.device("meta"):
        model = fam.model_cls(fam.flavors["debug"])
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    return model


def make_samples() -> list[Sample]:
    rng = random.Random(0)
    samples = []
    for _ in range(14):
        prompt = [rng.randrange(3, ARGS.vocab_size) for _ in range(rng.randint(3, 12))]
        completion = [rng.randrange(3, ARGS.vocab_size) for _ in range(rng.randint(2, 30))]
        logprobs = [-4.85 + rng.uniform(-0.3, 0.3) for _ in completion]
        samples.append(Sample(prompt, completion, logprobs, advantage=rng.uniform(-1, 1)))
    return samples


def _job(rank, world_size, family, degrees, ac, ac_every, out):
    dims = ParallelDims.resolve(world_size, **degrees)
    meshes = build_meshes(dims, list(range(world_size)), rank, "cpu")
    model = parallelize(make_model(family), meshes, torch.float32, ac=ac, ac_every=ac_every)
    trainer = Trainer(model, OPTIM, torch.device("cpu"), torch.distributed.group.WORLD, meshes)
    batches = pack(make_samples(), SEQ_LEN, dims.num_data_ranks)
    stats = trainer.rl_step(batches[dims.data_rank(rank)], count_loss_tokens(batches), LOSS, temperature=0.7)
    full = {k: v.clone() for k, v in full_tensors(model)}
    if rank == 0:
        torch.save({"params": full, "stats": stats}, out / "trainer.pt")


def reference_step(family: str):
    model = make_model(family)
    trainer = Trainer(model, OPTIM, torch.device("cpu"), group=None)
    batches = pack(make_samples(), SEQ_LEN, 1)
    stats = trainer.rl_step(batches[0], count_loss_tokens(batches), LOSS, temperature=0.7)
    return {k: v.detach().clone() for k, v in model.named_parameters()}, stats


@pytest.mark.parametrize("world_size, family, degrees, ac, ac_every", [
    # heavy: HSDP is in the MoE HSDP case below, cp 2 in test_context_parallel.py
    pytest.param(4, "qwen3", dict(dp_replicate=2, dp_shard=2), "none", 1, marks=pytest.mark.heavy),
    pytest.param(4, "qwen3", dict(dp_shard=2, cp=2), "selective", 1, marks=pytest.mark.heavy),
    (2, "qwen3", dict(dp_shard=2), "full", 2),
    (2, "qwen3_moe", dict(dp_shard=2, ep=2), "full", 1),
    (4, "qwen3_moe", dict(dp_replicate=2, dp_shard=2, ep=2), "selective", 1),
], ids=["hsdp-2x2", "fsdp2-cp2-selective-ac", "fsdp2-full-ac-every-2", "moe-fsdp2-ep2-full-ac",
        "moe-hsdp-2x2-ep2-selective-ac"])
def test_parallel_step_equals_single_process(tmp_path, world_size, family, degrees, ac, ac_every):
    run_ranks(_job, world_size, family, degrees, ac, ac_every, tmp_path)
    got = torch.load(tmp_path / "trainer.pt")
    ref, ref_stats = reference_step(family)
    init = dict(make_model(family).named_parameters())
    assert got["params"].keys() == ref.keys()
    for name in ref:
        assert not torch.equal(ref[name], init[name].detach()), f"{name} did not change: the step is vacuous"
        torch.testing.assert_close(got["params"][name], ref[name], rtol=1e-5, atol=2e-6, msg=name)
    for key in ("loss", "mismatch_kl", "entropy", "masked_fraction", "grad_norm", "loss_tokens"):
        assert abs(got["stats"][key] - ref_stats[key]) <= 1e-5 * max(1.0, abs(ref_stats[key])), key
    # MoE: load statistics are logged. The aux loss is a per-row statistic, so another split
    # moves it a little; the bound catches a missing token weighting (off by the number of rows).
    if family == "qwen3_moe":
        assert got["stats"]["moe/load_max"] >= 1.0 >= got["stats"]["moe/load_min"] >= 0.0
        assert abs(got["stats"]["moe/aux_loss"] - ref_stats["moe/aux_loss"]) <= 0.05 * ref_stats["moe/aux_loss"]


def _steps(trainer, batches, rank_batches):
    """Step, evaluate, step: the second step must start from the first one's update (the blocks kept
    gathered between forward and backward are re-gathered after the optimizer step)."""
    first = trainer.rl_step(rank_batches, count_loss_tokens(batches), LOSS, temperature=0.7)
    loss = trainer.eval_loss(rank_batches)
    second = trainer.rl_step(rank_batches, count_loss_tokens(batches), LOSS, temperature=0.7)
    return first, loss, second


def _kept_job(rank, world_size, out):
    dims = ParallelDims.resolve(world_size)
    meshes = build_meshes(dims, list(range(world_size)), rank, "cpu")
    model = parallelize(make_model(), meshes, torch.float32, reshard_after_forward=False)
    trainer = Trainer(model, OPTIM, torch.device("cpu"), torch.distributed.group.WORLD, meshes)
    batches = pack(make_samples(), SEQ_LEN, dims.num_data_ranks)
    result = _steps(trainer, batches, batches[dims.data_rank(rank)])
    full = {k: v.clone() for k, v in full_tensors(model)}
    if rank == 0:
        torch.save({"params": full, "result": result}, out / "kept.pt")


@pytest.mark.parametrize("world_size", [1, 2])
def test_blocks_kept_gathered_from_forward_to_backward_give_the_single_process_steps(tmp_path, world_size):
    run_ranks(_kept_job, world_size, tmp_path)
    got = torch.load(tmp_path / "kept.pt")
    model = make_model()
    trainer = Trainer(model, OPTIM, torch.device("cpu"), group=None)
    batches = pack(make_samples(), SEQ_LEN, 1)
    ref = _steps(trainer, batches, batches[0])
    after_one = make_model()  # one reference step only: the kept run must differ from it (two updates)
    Trainer(after_one, OPTIM, torch.device("cpu"), group=None).rl_step(batches[0], count_loss_tokens(batches), LOSS,
                                                                       temperature=0.7)
    one = dict(after_one.named_parameters())
    for name, param in model.named_parameters():
        torch.testing.assert_close(got["params"][name], param.detach(), rtol=1e-5, atol=2e-6, msg=name)
        assert not torch.allclose(got["params"][name], one[name].detach(), rtol=1e-5, atol=2e-6), name
    (first, loss, second), (ref_first, ref_loss, ref_second) = got["result"], ref
    assert abs(loss - ref_loss) <= 1e-5 * max(1.0, abs(ref_loss))
    for got_stats, ref_stats in ((first, ref_first), (second, ref_second)):
        for key in ("loss", "mismatch_kl", "grad_norm"):
            assert abs(got_stats[key] - ref_stats[key]) <= 1e-5 * max(1.0, abs(ref_stats[key])), key
