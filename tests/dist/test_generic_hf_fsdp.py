"""The generic transformers wrapper trains under FSDP2: 2 gloo ranks, each decoder layer then the root
sharded, gradients summed over ranks (divide factor 1), the loss normalised by the global token
count. One AdamW step on the two halves of a batch must equal the single-process step on the
whole batch."""

import torch
import torch.nn.functional as F
import transformers
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from meshrl.models.generic_hf import HFCausalLM, build_generic
from tests.dist.multirank import run_ranks

VOCAB = 96
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2)
# A tied LM head (one parameter shared by the embedding and the head, in the root unit) and an untied one.
CASES = {
    "mistral_tied": transformers.MistralConfig(**SHAPE, sliding_window=None, tie_word_embeddings=True),
    "olmo2": transformers.Olmo2Config(**SHAPE, tie_word_embeddings=False),
}
BATCH, LENGTH = 4, 12
NUM_LAYERS = SHAPE["num_hidden_layers"]


def make_model(name: str) -> HFCausalLM:
    model = build_generic(CASES[name].to_dict())
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    return model


def make_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (BATCH, LENGTH + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]  # inputs, targets (B, T)


def train_step(model: HFCausalLM, inputs: torch.Tensor, targets: torch.Tensor, num_tokens: int,
               loss_scale: float = 1.0) -> None:
    """One AdamW step on loss = summed token cross-entropy / the global token count."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    positions = torch.arange(inputs.shape[1])[None].expand_as(inputs)

    def head(hidden, weight):  # runs inside the root FSDP unit, where the LM head is unsharded
        logits = F.linear(hidden, weight)  # (B, T, V)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")

    loss = model(inputs, positions, head=head) / num_tokens
    (loss * loss_scale).backward()
    optimizer.step()


def shard(model: HFCausalLM, mesh) -> float:
    """FSDP2 per decoder layer, then the root; gradients summed. Returns the loss scale that makes
    an averaging FSDP sum on a torch without the divide-factor API (the world size), else 1."""
    for block in model.layers.values():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    fsdp_modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    assert len(fsdp_modules) == NUM_LAYERS + 1
    if not all(hasattr(m, "set_gradient_divide_factor") for m in fsdp_modules):
        return float(mesh.size())
    for m in fsdp_modules:
        m.set_gradient_divide_factor(1.0)
        # gloo has no PREMUL_SUM, which a divide factor alone selects: force plain sums.
        if hasattr(m, "set_force_sum_reduction_for_comms"):
            m.set_force_sum_reduction_for_comms(True)
    return 1.0


def _job(rank, world_size, out):
    mesh = init_device_mesh("cpu", (world_size,))
    inputs, targets = make_batch()
    rows = slice(rank * BATCH // world_size, (rank + 1) * BATCH // world_size)
    results = {}
    for name in CASES:
        model = make_model(name)
        loss_scale = shard(model, mesh)
        train_step(model, inputs[rows], targets[rows], num_tokens=targets.numel(), loss_scale=loss_scale)
        full = {}
        for key, param in model.named_parameters():
            assert isinstance(param, DTensor), f"{key} is not sharded"
            full[key] = param.detach().full_tensor().clone()
        results[name] = (full, loss_scale)
    if rank == 0:
        torch.save(results, out / "sharded.pt")


def test_fsdp2_step_equals_single_process(tmp_path):
    run_ranks(_job, 2, tmp_path)
    results = torch.load(tmp_path / "sharded.pt")
    inputs, targets = make_batch()
    for name in CASES:
        got, _ = results[name]
        model = make_model(name)
        init = {k: v.detach().clone() for k, v in model.named_parameters()}
        train_step(model, inputs, targets, num_tokens=targets.numel())
        ref = dict(model.named_parameters())
        assert got.keys() == ref.keys()
        for key in ref:
            assert not torch.equal(ref[key].detach(), init[key]), f"{name} {key} did not change: the step is vacuous"
            # The first AdamW step moves every entry by about lr * sign(grad) = 1e-2; entries whose
            # gradient is near AdamW's eps turn reduction-order noise into ~1e-6 differences.
            torch.testing.assert_close(got[key], ref[key].detach(), rtol=1e-5, atol=1e-5, msg=f"{name} {key}")
