"""A step trained in parts (trainer.overlap_rollout: GRPO groups trained as they finish, one optimizer
step at the end) equals the step trained in one piece: single process in float64, and FSDP2 over 2 gloo
ranks with parts that leave one rank only a padding row."""

import random

import torch

from meshrl.parallel import full_tensors, parallelize
from meshrl.parallel.dims import ParallelDims, build_meshes
from meshrl.runtime.train.packing import Sample, count_loss_tokens, pack
from meshrl.runtime.train.trainer import Trainer
from tests.dist.multirank import run_ranks
from tests.dist.test_parallel_trainer import ARGS, LOSS, OPTIM, make_model

SEQ_LEN = 64
PARTS = [[3], [0, 4], [1], [2, 5]]  # the order the groups finished in; the last part ends the step
SCALE = 6 * 4 * 32  # a provisional normaliser, as the controller picks it (not the step's count)


def make_groups() -> list[list[Sample]]:
    """6 groups of 4 samples (one shared prompt each), group advantages that sum to zero."""
    rng = random.Random(0)
    groups = []
    for _ in range(6):
        prompt = [rng.randrange(3, ARGS.vocab_size) for _ in range(rng.randint(4, 10))]
        rewards = [rng.random() for _ in range(4)]
        mean = sum(rewards) / 4
        group = []
        for reward in rewards:
            completion = [rng.randrange(3, ARGS.vocab_size) for _ in range(rng.randint(2, 24))]
            group.append(Sample(prompt, completion, [-4.85 + rng.uniform(-0.3, 0.3) for _ in completion],
                                advantage=reward - mean))
        groups.append(group)
    return groups


def step_in_parts(trainer: Trainer, groups, num_ranks: int, data_rank: int, share: bool) -> dict:
    every = []
    for part in PARTS:
        batches = pack([s for g in part for s in groups[g]], SEQ_LEN, num_ranks, share_prompts=share)
        every += batches
        trainer.accumulate_rl(batches[data_rank], SCALE, LOSS, temperature=0.7)
    num_loss_tokens = count_loss_tokens(every)
    assert num_loss_tokens != SCALE  # else the rescaling would not be exercised
    return trainer.finish_rl_step(num_loss_tokens)


def step_whole(model, groups, optim=OPTIM) -> dict:
    batches = pack([s for g in range(len(groups)) for s in groups[g]], SEQ_LEN, 1)
    return Trainer(model, optim, torch.device("cpu"), group=None, attention="split").rl_step(
        batches[0], count_loss_tokens(batches), LOSS, temperature=0.7)


def test_parts_equal_the_whole_step_in_float64():
    # a small clip threshold: the gradients must be rescaled before clipping for the update to match
    optim = OPTIM.model_copy(update={"max_grad_norm": 0.05})
    groups = make_groups()
    ref = make_model().double()
    ref_stats = step_whole(ref, groups, optim)
    assert ref_stats["grad_norm"] > 0.05  # clipping is active
    for share in (False, True):
        model = make_model().double()
        trainer = Trainer(model, optim, torch.device("cpu"), group=None, attention="split")
        stats = step_in_parts(trainer, groups, 1, 0, share)
        init = dict(make_model().double().named_parameters())
        for (name, p), (_, r) in zip(model.named_parameters(), ref.named_parameters()):
            assert not torch.equal(r, init[name]), f"{name} did not change: the step is vacuous"
            # float64 weights, but the LM head computes logits and logprobs in fp32 (logprob_head.py):
            # other micro-batch splits move the update by ~3e-8 of lr 1e-2
            torch.testing.assert_close(p, r, rtol=0, atol=1e-7, msg=name)
        for key in ("loss", "pg_loss", "kl_loss", "mismatch_kl", "entropy", "grad_norm", "loss_tokens"):
            assert abs(stats[key] - ref_stats[key]) <= 1e-6 * max(1.0, abs(ref_stats[key])), (key, share)  # fp32 sums
        assert trainer.version == 1 and trainer._acc is None


def _job(rank, world_size, out):
    dims = ParallelDims.resolve(world_size, dp_shard=world_size)
    meshes = build_meshes(dims, list(range(world_size)), rank, "cpu")
    model = parallelize(make_model(), meshes, torch.float32)
    trainer = Trainer(model, OPTIM, torch.device("cpu"), torch.distributed.group.WORLD, meshes, attention="split")
    groups = make_groups()
    rows = [pack([s for g in part for s in groups[g]], SEQ_LEN, 2, share_prompts=True)[dims.data_rank(rank)]
            for part in PARTS]
    stats = step_in_parts(trainer, groups, dims.num_data_ranks, dims.data_rank(rank), share=True)
    full = {k: v.clone() for k, v in full_tensors(model)}
    padding_only = [all(int(mb["sample_ids"].max()) < 0 for mb in part) for part in rows]
    torch.save({"params": full, "stats": stats, "padding_only": padding_only}, out / f"trainer{rank}.pt")


def test_fsdp_parts_equal_the_single_process_step(tmp_path):
    run_ranks(_job, 2, tmp_path)
    got = [torch.load(tmp_path / f"trainer{r}.pt") for r in range(2)]
    # a one-group part gives one rank nothing but a padding row, and it still ran the same collectives
    assert any(any(g["padding_only"]) for g in got)
    model = make_model()
    ref_stats = step_whole(model, make_groups())
    for name, ref in model.named_parameters():
        for g in got:
            torch.testing.assert_close(g["params"][name], ref.detach(), rtol=1e-5, atol=2e-6, msg=name)
    for key in ("loss", "mismatch_kl", "entropy", "grad_norm", "loss_tokens"):
        for g in got:
            assert abs(g["stats"][key] - ref_stats[key]) <= 1e-5 * max(1.0, abs(ref_stats[key])), key
