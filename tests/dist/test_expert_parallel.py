"""Expert parallelism on 2 gloo ranks against a single-process reference.

Each rank gets its own batch (of a different size). The reference runs the unsharded model on
both batches in one process; with EP 2 every rank holds half of every MoE layer's experts and
exchanges tokens by all-to-all. Losses are normalised by the global token count, so after
summing the non-expert gradients over ranks every gradient equals the reference's (an expert
shard's gradient is already complete and is compared against its slice of the reference).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from meshrl.models.common.moe import moe_aux_loss
from meshrl.models.qwen3_moe import Qwen3Moe, Qwen3MoeArgs
from meshrl.parallel.expert_parallel import apply_expert_parallel, ep_gather_for, expert_modules
from tests.dist.multirank import run_ranks

ARGS = Qwen3MoeArgs(vocab_size=96, dim=32, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=8, hidden_dim=64,
                    moe_hidden_dim=16, num_experts=8, top_k=2, mlp_only_layers=(1,))
SHAPES = [(2, 11), (3, 7)]  # rank r's batch (B, T): different token counts per rank
AUX_COEF = 0.1  # large, so the router's aux-loss gradient matters in the comparison
EXPERT_KEYS = ("moe.experts.w1", "moe.experts.w2", "moe.experts.w3")


def make_model() -> Qwen3Moe:
    torch.manual_seed(0)
    model = Qwen3Moe(ARGS)
    model.init_weights(seed=0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("router.weight"):
                p.normal_(0.0, 0.5)  # spread the routing so every expert gets tokens from both ranks
    return model


def batch(rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + rank)
    b, t = SHAPES[rank]
    tokens = torch.randint(0, ARGS.vocab_size, (b, t), generator=gen)
    targets = torch.randint(0, ARGS.vocab_size, (b, t), generator=gen)
    return tokens, torch.arange(t).expand(b, t), targets


def loss_of(model: Qwen3Moe, rank: int) -> torch.Tensor:
    """This batch's share of the global loss: summed token CE / all tokens of the step, plus aux."""
    tokens, positions, targets = batch(rank)
    num_tokens = sum(b * t for b, t in SHAPES)
    logits = model(tokens, positions)
    ce = F.cross_entropy(logits.reshape(-1, ARGS.vocab_size), targets.reshape(-1), reduction="sum") / num_tokens
    return ce + AUX_COEF * moe_aux_loss(model)


def reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    model = make_model()
    losses = [loss_of(model, r) for r in range(len(SHAPES))]
    torch.stack(losses).sum().backward()
    return [l.item() for l in losses], {k: p.grad.clone() for k, p in model.named_parameters()}


def check_grads(rank: int, grads: dict[str, torch.Tensor], ref_grads: dict[str, torch.Tensor]) -> None:
    """grads: this rank's gradients, expert ones local shards, the others not yet summed."""
    assert grads.keys() == ref_grads.keys()
    local = ARGS.num_experts // 2
    for key, grad in grads.items():
        if key.endswith(EXPERT_KEYS):
            assert grad.shape[0] == local, key
            expected = ref_grads[key][rank * local:(rank + 1) * local]
        else:
            dist.all_reduce(grad)
            expected = ref_grads[key]
        torch.testing.assert_close(grad, expected, rtol=1e-4, atol=1e-6, msg=key)


def _ep_vs_single_process(rank: int, world_size: int) -> None:
    ref_losses, ref_grads = reference()
    full = make_model()
    model = copy.deepcopy(full)
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("ep",))
    apply_expert_parallel(model, mesh)
    assert model.layers["0"].moe.experts.w1.shape[0] == ARGS.num_experts // world_size
    assert not hasattr(model.layers["1"], "moe")

    # Forward only: this rank's outputs equal the unsharded model's on the same batch.
    tokens, positions, _ = batch(rank)
    with torch.no_grad():
        torch.testing.assert_close(model(tokens, positions), full(tokens, positions), rtol=1e-5, atol=1e-6)

    loss = loss_of(model, rank)
    loss.backward()
    assert loss.item() == pytest.approx(ref_losses[rank], rel=1e-6)
    check_grads(rank, {k: p.grad for k, p in model.named_parameters()}, ref_grads)

    # Full weights come back from the shards (what weight sync and export need).
    for name, param in model.named_parameters():
        gather = ep_gather_for(model, name)
        assert (gather is None) == (not name.endswith(EXPERT_KEYS)), name
        if gather is not None:
            assert param._meshrl_ep_gather is not None
            assert torch.equal(gather(param.detach()), full.get_parameter(name)), name

    with pytest.raises(ValueError, match="already"):
        apply_expert_parallel(model, mesh)
    odd = Qwen3Moe(Qwen3MoeArgs(vocab_size=96, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=8,
                                moe_hidden_dim=16, num_experts=3, top_k=2))
    with pytest.raises(ValueError, match="divide"):
        apply_expert_parallel(odd, mesh)


@pytest.mark.heavy  # the EP all-to-all without FSDP; the FSDP2 case below runs by default
def test_expert_parallel_matches_single_process():
    run_ranks(_ep_vs_single_process, 2)


def _ep_under_fsdp2(rank: int, world_size: int) -> None:
    """EP 2 composed with FSDP2 the way the trainer composes them: the expert groups on their own
    (here 1-rank) expert-FSDP mesh, built from a separate process group, then blocks and root on
    the dense mesh; gradients summed (divide factor 1)."""
    ref_losses, ref_grads = reference()
    model = make_model()
    dense_mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp_shard_cp",))
    ep_mesh = DeviceMesh.from_group(dist.new_group(list(range(world_size))), "cpu", mesh_dim_names=("ep",))
    singletons = [dist.new_group([r]) for r in range(world_size)]  # every rank creates every group
    expert_mesh = DeviceMesh.from_group(singletons[rank], "cpu", mesh_dim_names=("dp_shard_mod_ep",))
    apply_expert_parallel(model, ep_mesh)
    units = [fully_shard(experts, mesh=expert_mesh) for experts in expert_modules(model)]
    units += [fully_shard(block, mesh=dense_mesh) for block in model.layers.values()]
    units.append(fully_shard(model, mesh=dense_mesh))
    for unit in units:
        unit.set_gradient_divide_factor(1.0)
        unit.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM

    loss = loss_of(model, rank)
    loss.backward()
    assert loss.item() == pytest.approx(ref_losses[rank], rel=1e-6)
    local = ARGS.num_experts // world_size
    for key, param in model.named_parameters():
        grad = param.grad.full_tensor()  # FSDP already summed the dense gradients over both ranks
        expected = ref_grads[key][rank * local:(rank + 1) * local] if key.endswith(EXPERT_KEYS) else ref_grads[key]
        torch.testing.assert_close(grad, expected, rtol=1e-4, atol=1e-6, msg=key)
        assert isinstance(param, DTensor)

    # Full weights after FSDP2 (weight sync, export): FSDP's full tensor, then the gather over ep.
    # fully_shard replaced the parameter objects, so the gather is found through the module.
    full = make_model()
    for key, param in model.named_parameters():
        value = param.detach().full_tensor()
        gather = ep_gather_for(model, key)
        assert (gather is not None) == key.endswith(EXPERT_KEYS), key
        assert torch.equal(gather(value) if gather is not None else value, full.get_parameter(key)), key


def test_expert_parallel_under_fsdp2():
    run_ranks(_ep_under_fsdp2, 2)
