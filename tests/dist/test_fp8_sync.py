"""Weight sync into an FP8 engine (real processes, gloo): after every version the engine's e4m3
weights and scales equal quantise(trainer weights) exactly and every other parameter equals the
trainer's, through the split layout's bucket broadcast and through the colocated shared buffer;
the engine quantises in place (same storages, so captured CUDA graphs stay valid) between steps
of requests in flight, and tokens sampled after the sync record the new version."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from meshrl.models.common.fp8 import FP8, Fp8Linear, quantize_blocks
from meshrl.models.qwen3 import FLAVORS, Qwen3
from meshrl.runtime import weight_sync
from meshrl.runtime.engine.api import Request, SamplingParams
from meshrl.runtime.engine.native import NativeEngine
from meshrl.runtime.layout import assign_roles, build_layout
from tests.dist.multirank import run_ranks
from tests.family_checks import build_init

ARGS = FLAVORS["debug"]
WIRE = torch.bfloat16  # what the trainer sends (the inference dtype)


def make_model(seed: int) -> Qwen3:
    return build_init(Qwen3, ARGS, seed)


def new_version(model: Qwen3, version: int) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1 + 0.1 * version).add_(0.01 * version)


def fp8_engine() -> NativeEngine:
    return NativeEngine(make_model(seed=7), max_num_seqs=2, max_model_len=48, device="cpu", dtype=torch.float32,
                        block_size=4, quantization="fp8")


def engine_state(engine: NativeEngine) -> list[tuple[str, torch.Tensor, torch.Tensor | None]]:
    """(name, parameter, its Fp8Linear's scales or None) of every engine parameter, copied."""
    owners = {id(m.weight): m for m in engine.model.modules() if isinstance(m, Fp8Linear)}
    return [(name, p.detach().clone(), owners[id(p)].weight_scale_inv.clone() if id(p) in owners else None)
            for name, p in engine.model.named_parameters()]


def check_equals_quantised(state, trainer_state: list[torch.Tensor]) -> None:
    assert sum(s is not None for _, _, s in state) == 2 * 7
    for (name, p, scales), full in zip(state, trainer_state, strict=True):
        if scales is not None:
            q, s = quantize_blocks(full)
            assert p.dtype == FP8 and torch.equal(p.view(torch.uint8), q.view(torch.uint8)), name
            assert torch.equal(scales, s), name
        else:
            assert torch.equal(p, full.to(p.dtype)), name


def _split(rank, world_size, out):
    group = dist.group.WORLD
    if rank == 0:
        model = make_model(seed=0)
        for version in range(2):
            if version:
                new_version(model, version)
            weight_sync.send_weights(model, group, 0, WIRE, 0.01, torch.device("cpu"))
            torch.save([p.detach().to(WIRE).clone() for p in model.parameters()], out / f"trainer_v{version}.pt")
        return
    engine = fp8_engine()
    storages = [p.data_ptr() for p in engine.model.parameters()]
    weight_sync.receive_weights(engine.model, group, 0, WIRE, 0.01, torch.device("cpu"))
    engine.set_version(0)
    engine.add(Request(0, [3, 4, 5, 6], SamplingParams(temperature=0.0, max_tokens=12)))
    for _ in range(4):
        engine.step()
    weight_sync.receive_weights(engine.model, group, 0, WIRE, 0.01, torch.device("cpu"))  # between two steps
    engine.set_version(1)
    done = []
    while engine.has_work():
        done += engine.step()
    assert [p.data_ptr() for p in engine.model.parameters()] == storages  # in place
    assert done[0].versions[0] == 0 and done[0].versions[-1] == 1
    torch.save(engine_state(engine), out / "engine_v1.pt")


def test_split_layout_sync_into_an_fp8_engine_equals_quantise_of_the_trainer(tmp_path):
    run_ranks(_split, 2, tmp_path)
    check_equals_quantised(torch.load(tmp_path / "engine_v1.pt"), torch.load(tmp_path / "trainer_v1.pt"))


def _colocated(rank, world_size, out):
    roles = assign_roles(world_size, 1, 1, controller=2, colocated=True)
    lay = build_layout(roles, rank, torch.device("cpu"), timeout_s=120, message_timeout_s=120, cuda=False)
    if lay.role == "trainer":
        model = make_model(seed=0)
        sender = weight_sync.ColocatedSender(model, WIRE, torch.device("cpu"), lay.peer, lay.to_peer, lay.from_peer)
        for version in range(3):
            if version:
                new_version(model, version)
            sender.send(model, version)
            torch.save([p.detach().to(WIRE).clone() for p in model.parameters()], out / f"trainer_v{version}.pt")
        sender._wait_copied()  # keep the last signal's send alive until the engine has it (a dropped gloo isend is lost)
        sender.close()
    elif lay.role == "inference":
        engine = fp8_engine()
        receiver = weight_sync.ColocatedReceiver(engine.model, WIRE, torch.device("cpu"), lay.peer, lay.to_peer,
                                                 lay.from_peer)
        assert receiver.flat is None  # no bf16 copy of the model on the engine's side
        storages = [p.data_ptr() for p in engine.model.parameters()]
        receiver.receive_first()
        for version in (1, 2):
            receiver.receive(version)
            torch.save(engine_state(engine), out / f"engine_v{version}.pt")
        assert [p.data_ptr() for p in engine.model.parameters()] == storages
        receiver.close()


@pytest.mark.heavy  # the colocated buffer's FP8 load; the split layout's case runs by default
def test_colocated_sync_into_an_fp8_engine_equals_quantise_of_the_trainer(tmp_path):
    run_ranks(_colocated, 3, tmp_path)
    for version in (1, 2):
        check_equals_quantised(torch.load(tmp_path / f"engine_v{version}.pt"), torch.load(tmp_path / f"trainer_v{version}.pt"))
