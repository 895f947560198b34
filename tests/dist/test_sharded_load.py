"""Loading an HF folder straight into FSDP2 + expert-parallel shards equals loading it whole.

2 gloo ranks, Qwen3-MoE debug with ep = 2 (experts split over ranks, then FSDP2 on the expert
mesh) and FSDP2 over both ranks for the dense weights. Each rank reads only its own pieces;
gathering them back (as weight sync and export do) must give the checkpoint bit for bit.
"""

import torch
from torch.distributed.tensor import DTensor

from meshrl.models import get_family
from meshrl.models.hf import load_hf_model, save_hf_model
from meshrl.parallel import full_tensors, parallelize
from meshrl.parallel.dims import ParallelDims, build_meshes
from meshrl.runtime.config import ModelConfig
from meshrl.runtime.policy import build_trainer_policy
from tests.dist.multirank import run_ranks


def _job(rank, world_size, folder, out):
    dims = ParallelDims.resolve(world_size, dp_shard=2, ep=2)
    meshes = build_meshes(dims, [0, 1], rank, "cpu")
    model, _ = build_trainer_policy(ModelConfig(path=str(folder)), torch.device("cpu"),
                                    lambda m: parallelize(m, meshes, torch.float32))
    experts = model.layers["0"].moe.experts
    # 8 experts over ep 2 = 4 here; the expert FSDP mesh (dp_shard x cp / ep) has one rank
    assert experts.w1.to_local().shape[0] == 4 and experts.num_global_experts == 8
    assert all(isinstance(p, DTensor) for p in model.parameters()), "every parameter must be an FSDP shard"
    full = {k: v.clone() for k, v in full_tensors(model)}
    if rank == 0:
        torch.save(full, out / "full.pt")


def test_hf_folder_loads_into_fsdp_and_expert_shards(tmp_path):
    family = get_family("qwen3_moe")
    args = family.flavors["debug"]
    with torch.device("meta"):
        model = family.model_cls(args)
    model.to_empty(device="cpu")
    model.init_weights(seed=3)
    save_hf_model(model, args, tmp_path / "hf")
    run_ranks(_job, 2, tmp_path / "hf", tmp_path)
    got = torch.load(tmp_path / "full.pt")
    ref, _ = load_hf_model(tmp_path / "hf")
    ref = dict(ref.named_parameters())
    assert got.keys() == ref.keys()
    for name, value in ref.items():
        assert torch.equal(got[name], value.detach()), name
