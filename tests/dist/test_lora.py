"""LoRA under FSDP2 on real gloo processes: the sharded step equals the single-process step, and
the merged weights reach the engines bit for bit (split layout broadcast, colocated buffer).

The base weights are frozen, so each FSDP2 unit mixes frozen and trainable parameters; only the
adapters are in AdamW. "Bit for bit" is against `merge_weight` of the same adapter values on one
process, cast to the sync dtype.
"""

import pytest
import torch

from meshrl.models.common.lora import LoRALinear, merge_weight
from meshrl.parallel import full_adapters, parallelize
from meshrl.runtime import weight_sync
from meshrl.runtime.config import LossConfig, OptimConfig
from meshrl.runtime.layout import assign_roles, build_layout
from meshrl.runtime.train.packing import count_loss_tokens, pack
from meshrl.runtime.train.trainer import Trainer
from tests.dist.multirank import run_ranks
from tests.dist.test_parallel_trainer import SEQ_LEN, make_samples
from tests.unit.test_lora import base_model, lora_model

OPTIM = OptimConfig(lr=1e-2, weight_decay=0.01, eps=1e-4)  # eps: see test_parallel_trainer
LOSS = LossConfig(kl_coef=0.1)
BUCKET_MB = 0.01  # several buckets even for the tiny model


def _split_job(rank, world_size, out):
    roles = assign_roles(world_size, 2, 1, controller=world_size - 1)
    lay = build_layout(roles, rank, torch.device("cpu"), timeout_s=120, message_timeout_s=120, cuda=False)
    if lay.role == "trainer":
        model = parallelize(lora_model(), lay.trainer_meshes, torch.float32, ac="full")
        trainer = Trainer(model, OPTIM, torch.device("cpu"), lay.trainer_group, lay.trainer_meshes)
        batches = pack(make_samples(), SEQ_LEN, 2)
        stats = trainer.rl_step(batches[lay.trainer_meshes.data_rank], count_loss_tokens(batches), LOSS, 0.7)
        group = lay.sync_group if lay.is_trainer_leader else None
        weight_sync.send_weights(model, group, roles.trainers[0], torch.bfloat16, BUCKET_MB, torch.device("cpu"))
        adapters = full_adapters(model)
        frozen = {n: p.full_tensor() for n, p in model.named_parameters() if not p.requires_grad}
        if lay.is_trainer_leader:
            optimized = {id(p) for g in trainer.optimizer.param_groups for p in g["params"]}
            names = sorted(n for n, p in model.named_parameters() if id(p) in optimized)
            torch.save({"adapters": adapters, "stats": stats, "frozen": frozen, "optimized": names}, out / "trainer.pt")
    elif lay.role == "inference":
        model = base_model(seed=123).to(torch.bfloat16)  # other weights: the broadcast must overwrite them all
        weight_sync.receive_weights(model, lay.sync_group, roles.trainers[0], torch.bfloat16, BUCKET_MB,
                                    torch.device("cpu"))
        torch.save({k: v.detach().clone() for k, v in model.named_parameters()}, out / "inference.pt")


def merged_reference(adapters, dtype):
    """The policy merged on this one process from the given adapters, cast to `dtype`."""
    model = lora_model()
    out = {}
    for name, p in model.named_parameters():
        path, _, leaf = name.rpartition(".")
        module = model.get_submodule(path)
        if isinstance(module, LoRALinear) and leaf == "weight":
            a, b = adapters[path]
            out[name] = merge_weight(p.detach(), a, b, module.lora_scale).to(dtype)
        elif not leaf.startswith("lora_"):
            out[name] = p.detach().to(dtype)
    return out


def test_lora_fsdp2_step_equals_single_process_and_the_engine_gets_merged_weights_bit_for_bit(tmp_path):
    run_ranks(_split_job, 4, tmp_path)
    got = torch.load(tmp_path / "trainer.pt")
    model = lora_model()
    init = {p: (m.lora_a.detach().clone(), m.lora_b.detach().clone())
            for p, m in model.named_modules() if isinstance(m, LoRALinear)}
    ref_trainer = Trainer(model, OPTIM, torch.device("cpu"), group=None)
    batches = pack(make_samples(), SEQ_LEN, 1)
    ref_stats = ref_trainer.rl_step(batches[0], count_loss_tokens(batches), LOSS, 0.7)
    assert got["optimized"] == sorted(n for n, p in model.named_parameters() if n.rpartition(".")[2].startswith("lora_"))
    for path, m in model.named_modules():
        if not isinstance(m, LoRALinear):
            continue
        for i, ref in enumerate((m.lora_a, m.lora_b)):
            assert not torch.equal(ref.detach(), init[path][i]), f"{path}: the step is vacuous"
            torch.testing.assert_close(got["adapters"][path][i], ref.detach(), rtol=1e-5, atol=2e-6, msg=path)
    base = dict(base_model().named_parameters())
    for name, t in got["frozen"].items():
        assert torch.equal(t, base[name].detach()), f"{name}: a frozen weight moved"
    for key in ("loss", "mismatch_kl", "entropy", "grad_norm", "loss_tokens"):
        assert abs(got["stats"][key] - ref_stats[key]) <= 1e-5 * max(1.0, abs(ref_stats[key])), key
    engine = torch.load(tmp_path / "inference.pt")
    want = merged_reference(got["adapters"], torch.bfloat16)
    assert engine.keys() == want.keys()
    for name in want:
        assert torch.equal(engine[name], want[name]), f"{name}: engine != single-process merge"


def _colocated_job(rank, world_size, out):
    roles = assign_roles(world_size, 2, 2, controller=world_size - 1, colocated=True)
    lay = build_layout(roles, rank, torch.device("cpu"), timeout_s=120, message_timeout_s=120, cuda=False)
    if lay.role == "trainer":
        model = parallelize(lora_model(), lay.trainer_meshes, torch.float32)
        sender = weight_sync.ColocatedSender(model, torch.float32, torch.device("cpu"), lay.peer, lay.to_peer,
                                             lay.from_peer)
        for version in range(2):
            if version:
                with torch.no_grad():  # a new version: every adapter shard changes
                    for m in model.modules():
                        if isinstance(m, LoRALinear):
                            m.lora_a.add_(0.01)
                            m.lora_b.add_(0.02)
            sender.send(model, version)
            adapters = full_adapters(model)
            if lay.is_trainer_leader:
                torch.save(adapters, out / f"adapters_v{version}.pt")
        sender.close()
    elif lay.role == "inference":
        model = base_model(seed=123)
        receiver = weight_sync.ColocatedReceiver(model, torch.float32, torch.device("cpu"), lay.peer, lay.to_peer,
                                                 lay.from_peer)
        receiver.receive_first()
        torch.save({k: v.detach().clone() for k, v in model.named_parameters()}, out / f"engine{rank}_v0.pt")
        receiver.receive(1)
        torch.save({k: v.detach().clone() for k, v in model.named_parameters()}, out / f"engine{rank}_v1.pt")
        receiver.close()


@pytest.mark.heavy  # the merged weights' path is the split test's; this adds the colocated buffer
def test_colocated_engines_get_the_merged_weights_bit_for_bit(tmp_path):
    run_ranks(_colocated_job, 5, tmp_path)
    engines = sorted(tmp_path.glob("engine*_v*.pt"))
    assert len(engines) == 4
    for path in engines:
        version = path.stem.split("_v")[1]
        want = merged_reference(torch.load(tmp_path / f"adapters_v{version}.pt"), torch.float32)
        got = torch.load(path)
        assert got.keys() == want.keys()
        for name in want:
            assert torch.equal(got[name], want[name]), f"{path.name}: {name} != single-process merge"
    v0, v1 = (torch.load(tmp_path / f"engine{engines[0].stem[6]}_v{v}.pt") for v in (0, 1))
    assert not torch.equal(v0["layers.0.attention.wq.weight"], v1["layers.0.attention.wq.weight"])
