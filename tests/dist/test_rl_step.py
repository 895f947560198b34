"""Controller + 2 FSDP2 trainer ranks + 1 inference rank, real processes on gloo.

One RL step on the sharded trainer must equal the same step in a single process, and after
the weight broadcast the inference rank's weights must equal the trainer's full weights bit
for bit.
"""

import random

import torch
from tensordict import TensorDict

from meshrl.models.qwen3 import FLAVORS, Qwen3
from meshrl.parallel import full_tensors, parallelize
from meshrl.runtime import transport, weight_sync
from meshrl.runtime.config import LossConfig, OptimConfig
from meshrl.runtime.layout import assign_roles, build_layout
from meshrl.runtime.train.packing import Sample, count_loss_tokens, pack
from meshrl.runtime.train.trainer import Trainer
from meshrl.runtime.transport import Message
from tests.dist.multirank import run_ranks
from tests.family_checks import build_init

ARGS = FLAVORS["debug"]
OPTIM = OptimConfig(lr=1e-2, weight_decay=0.01)
LOSS = LossConfig(kl_coef=0.1)
SEQ_LEN = 96
BUCKET_MB = 0.01  # several buckets even for the tiny model


def make_model(seed: int) -> Qwen3:
    return build_init(Qwen3, ARGS, seed)


def make_samples() -> list[Sample]:
    rng = random.Random(0)
    samples = []
    for _ in range(12):
        prompt = [rng.randrange(3, ARGS.vocab_size) for _ in range(rng.randint(3, 10))]
        completion = [rng.randrange(3, ARGS.vocab_size) for _ in range(rng.randint(2, 20))]
        logprobs = [-4.85 + rng.uniform(-0.3, 0.3) for _ in completion]
        samples.append(Sample(prompt, completion, logprobs, advantage=rng.uniform(-1, 1)))
    return samples


def _job(rank, world_size, out):
    roles = assign_roles(world_size, 2, 1, controller=world_size - 1)
    lay = build_layout(roles, rank, torch.device("cpu"), timeout_s=120, message_timeout_s=120, cuda=False)
    if lay.role == "controller":
        batches = pack(make_samples(), SEQ_LEN, 2)
        n = count_loss_tokens(batches)
        for r, mbs in zip(roles.trainers, batches):
            data = TensorDict({str(i): mb for i, mb in enumerate(mbs)}, batch_size=[])
            transport.send(Message("train", {"num_loss_tokens": n, "num_micro_batches": len(mbs)}, data),
                           r, lay.down[r])
    elif lay.role == "trainer":
        model = make_model(seed=0)
        parallelize(model, lay.trainer_meshes, torch.float32)
        trainer = Trainer(model, OPTIM, torch.device("cpu"), lay.trainer_group, lay.trainer_meshes)
        group = lay.sync_group if lay.is_trainer_leader else None
        weight_sync.send_weights(model, group, roles.trainers[0], torch.float32, BUCKET_MB, torch.device("cpu"))
        msg = transport.recv(roles.controller, lay.down[rank])
        mbs = [msg.data[str(i)] for i in range(msg.meta["num_micro_batches"])]
        stats = trainer.rl_step(mbs, msg.meta["num_loss_tokens"], LOSS, temperature=0.7)
        weight_sync.send_weights(model, group, roles.trainers[0], torch.float32, BUCKET_MB, torch.device("cpu"))
        full = {k: v.clone() for k, v in full_tensors(model)}
        if lay.is_trainer_leader:
            torch.save({"params": full, "stats": stats}, out / "trainer.pt")
    else:
        model = make_model(seed=123)  # different weights: the broadcast must overwrite all of them
        for _ in range(2):
            weight_sync.receive_weights(model, lay.sync_group, roles.trainers[0], torch.float32, BUCKET_MB,
                                        torch.device("cpu"))
        torch.save({k: v.detach().clone() for k, v in model.named_parameters()}, out / "inference.pt")


def reference_step():
    model = make_model(seed=0)
    trainer = Trainer(model, OPTIM, torch.device("cpu"), group=None)
    batches = pack(make_samples(), SEQ_LEN, 1)
    stats = trainer.rl_step(batches[0], count_loss_tokens(batches), LOSS, temperature=0.7)
    return {k: v.detach().clone() for k, v in model.named_parameters()}, stats


def test_sharded_step_equals_single_process_and_sync_is_exact(tmp_path):
    run_ranks(_job, 4, tmp_path)
    got = torch.load(tmp_path / "trainer.pt")
    inference = torch.load(tmp_path / "inference.pt")
    ref, ref_stats = reference_step()
    init = dict(make_model(seed=0).named_parameters())
    assert got["params"].keys() == ref.keys() == inference.keys()
    for name in ref:
        assert not torch.equal(ref[name], init[name].detach()), f"{name} did not change: the step is vacuous"
        torch.testing.assert_close(got["params"][name], ref[name], rtol=1e-5, atol=1e-6, msg=name)
        assert torch.equal(inference[name], got["params"][name]), f"{name}: inference != trainer after sync"
    for key in ("loss", "mismatch_kl", "entropy", "masked_fraction", "grad_norm", "loss_tokens"):
        assert abs(got["stats"][key] - ref_stats[key]) <= 1e-5 * max(1.0, abs(ref_stats[key])), key
