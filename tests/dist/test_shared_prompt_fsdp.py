"""Shared-prompt packing under data sharding: FSDP2 over 2 gloo ranks, each rank getting whole units
(a prompt and its branches), gives the single-process step with unshared packing."""

import random

import torch

from meshrl.parallel import full_tensors, parallelize
from meshrl.parallel.dims import ParallelDims, build_meshes
from meshrl.runtime.train.packing import Sample, count_loss_tokens, pack
from meshrl.runtime.train.shared_prompt import is_shared
from meshrl.runtime.train.trainer import Trainer
from tests.dist.multirank import run_ranks
from tests.dist.test_parallel_trainer import ARGS, LOSS, OPTIM, make_model

SEQ_LEN = 96


def make_samples() -> list[Sample]:
    """4 prompts x 4 samples, one prompt with a single sample; interleaved as a controller's groups are not."""
    rng = random.Random(0)
    samples = []
    for g, count in enumerate([4, 4, 4, 1]):
        prompt = [rng.randrange(3, ARGS.vocab_size) for _ in range(rng.randint(6, 14))]
        for _ in range(count):
            completion = [rng.randrange(3, ARGS.vocab_size) for _ in range(rng.randint(2, 20))]
            samples.append(Sample(prompt, completion, [-4.85 + rng.uniform(-0.3, 0.3) for _ in completion],
                                  advantage=rng.uniform(-1, 1)))
    rng.shuffle(samples)
    return samples


def _job(rank, world_size, out):
    dims = ParallelDims.resolve(world_size, dp_shard=world_size)
    meshes = build_meshes(dims, list(range(world_size)), rank, "cpu")
    model = parallelize(make_model(), meshes, torch.float32)
    trainer = Trainer(model, OPTIM, torch.device("cpu"), torch.distributed.group.WORLD, meshes, attention="split")
    batches = pack(make_samples(), SEQ_LEN, dims.num_data_ranks, share_prompts=True)
    mine = batches[dims.data_rank(rank)]
    stats = trainer.rl_step(mine, count_loss_tokens(batches), LOSS, temperature=0.7)
    full = {k: v.clone() for k, v in full_tensors(model)}
    torch.save({"params": full, "stats": stats, "shared": any(is_shared(mb) for mb in mine),
                "tokens": sum(mb["input_ids"].shape[1] for mb in mine)}, out / f"trainer{rank}.pt")


def test_fsdp_shared_prompts_equal_single_process_unshared(tmp_path):
    run_ranks(_job, 2, tmp_path)
    got = [torch.load(tmp_path / f"trainer{r}.pt") for r in range(2)]
    assert all(g["shared"] for g in got) and min(g["tokens"] for g in got) > 1  # both ranks train shared units
    model = make_model()
    batches = pack(make_samples(), SEQ_LEN, 1)
    ref_stats = Trainer(model, OPTIM, torch.device("cpu"), group=None).rl_step(
        batches[0], count_loss_tokens(batches), LOSS, temperature=0.7)
    init = dict(make_model().named_parameters())
    for name, ref in model.named_parameters():
        assert not torch.equal(ref, init[name]), f"{name} did not change: the step is vacuous"
        torch.testing.assert_close(got[0]["params"][name], ref.detach(), rtol=1e-5, atol=2e-6, msg=name)
    for key in ("loss", "mismatch_kl", "entropy", "grad_norm", "loss_tokens"):
        assert abs(got[0]["stats"][key] - ref_stats[key]) <= 1e-5 * max(1.0, abs(ref_stats[key])), key
    assert got[0]["stats"]["train_tokens"] < ref_stats["train_tokens"]
