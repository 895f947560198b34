"""The colocated weight path: 2 FSDP2 trainer ranks, each paired with an engine on its device.

Every engine's weights must equal the trainer's full weights bit for bit after each version, the
versions must arrive in order, and an out-of-order version must raise (real processes, gloo; the
GPU variant uses CUDA IPC between two processes on one GPU).
"""

import pytest
import torch

from meshrl.models.qwen3 import FLAVORS, Qwen3
from meshrl.parallel import full_tensors, parallelize
from meshrl.runtime.layout import assign_roles, build_layout
from meshrl.runtime.weight_sync import ColocatedReceiver, ColocatedSender
from tests.dist.multirank import run_ranks

ARGS = FLAVORS["debug"]


def make_model(seed: int, device: str = "cpu") -> Qwen3:
    with torch.device("meta"):
        model = Qwen3(ARGS)
    model.to_empty(device=device)
    model.init_weights(seed=seed)
    return model


def _job(rank, world_size, num_pairs, device_type, dtype, out):
    device = torch.device(device_type, rank % num_pairs) if device_type == "cuda" else torch.device("cpu")
    roles = assign_roles(world_size, num_pairs, num_pairs, controller=world_size - 1, colocated=True)
    lay = build_layout(roles, rank, device, timeout_s=120, message_timeout_s=120, cuda=device_type == "cuda")
    if lay.role == "controller":
        return
    if lay.role == "trainer":
        model = parallelize(make_model(seed=0, device=str(device)), lay.trainer_meshes, torch.float32)
        sender = ColocatedSender(model, dtype, device, lay.peer, lay.to_peer, lay.from_peer)
        for version in range(3):
            if version:
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_(0.01 * version)  # a new version: every shard changes
            sender.send(model, version)
            full = [t.to(dtype).cpu().clone() for _, t in full_tensors(model)]
            if lay.rank == roles.trainers[0]:
                torch.save(full, out / f"trainer_v{version}.pt")
        sender.close()
    else:
        engine_model = make_model(seed=1, device=str(device)).to(dtype)  # other values until the first copy
        receiver = ColocatedReceiver(engine_model, dtype, device, lay.peer, lay.to_peer, lay.from_peer)
        got = [receiver.receive_first()]
        torch.save([p.detach().cpu().clone() for p in engine_model.parameters()], out / f"engine{lay.rank}_v0.pt")
        for version in (1, 2):
            receiver.receive(version)
            got.append(version)
            torch.save([p.detach().cpu().clone() for p in engine_model.parameters()],
                       out / f"engine{lay.rank}_v{version}.pt")
        assert got == [0, 1, 2]
        receiver.close()


def _check(out, num_pairs):
    engines = sorted(out.glob("engine*_v*.pt"))
    assert len(engines) == 3 * num_pairs
    for path in engines:
        version = path.stem.split("_v")[1]
        trainer = torch.load(out / f"trainer_v{version}.pt")
        for a, b in zip(torch.load(path), trainer, strict=True):
            assert torch.equal(a, b), f"{path.name}: engine weights differ from the trainer's at version {version}"
    first, last = torch.load(out / "trainer_v0.pt"), torch.load(out / "trainer_v2.pt")
    assert not any(torch.equal(a, b) for a, b in zip(first, last)), "the versions must differ"


def test_colocated_engines_get_the_trainers_weights_bit_for_bit(tmp_path):
    run_ranks(_job, 5, 2, "cpu", torch.float32, tmp_path)
    _check(tmp_path, 2)


def _out_of_order(rank, world_size):
    roles = assign_roles(world_size, 1, 1, controller=2, colocated=True)
    lay = build_layout(roles, rank, torch.device("cpu"), timeout_s=60, message_timeout_s=60, cuda=False)
    if lay.role == "trainer":
        model = make_model(seed=0)
        sender = ColocatedSender(model, torch.float32, torch.device("cpu"), lay.peer, lay.to_peer, lay.from_peer)
        sender.send(model, 0)
        sender.send(model, 1)
        sender.close()  # v1's signal must leave before this process ends
    elif lay.role == "inference":
        receiver = ColocatedReceiver(make_model(seed=0), torch.float32, torch.device("cpu"), lay.peer, lay.to_peer,
                                     lay.from_peer)
        receiver.receive_first()
        with pytest.raises(RuntimeError, match="wrote weights v1 but the controller asked for v2"):
            receiver.receive(2)


@pytest.mark.heavy  # 3 gloo ranks for one assertion; the version protocol runs in every colocated RL test
def test_an_unexpected_version_raises():
    run_ranks(_out_of_order, 3)


@pytest.mark.gpu
def test_colocated_weights_through_cuda_ipc_bit_for_bit(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    run_ranks(_job, 3, 1, "cuda", torch.bfloat16, tmp_path, backend="cpu:gloo,cuda:nccl", devices=[0, 0, 0])
    _check(tmp_path, 1)
