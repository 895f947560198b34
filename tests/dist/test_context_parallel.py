import pytest
import torch
import torch.distributed as dist

from meshrl.models.common.attention import DocumentCausalAttention
from meshrl.models.qwen3 import FLAVORS, Qwen3
from meshrl.parallel.context_parallel import ContextParallelAttention, cp_split, pad_for_cp
from meshrl.runtime.train import losses
from meshrl.runtime.train.packing import Sample, pack
from tests.dist.multirank import run_ranks


def _model() -> Qwen3:
    with torch.device("meta"):
        model = Qwen3(FLAVORS["debug"])
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    return model


def _row():
    """One packed row of 4 documents of different lengths, 106 tokens (padding needed for cp 2 and 4)."""
    gen = torch.Generator().manual_seed(1)
    vocab = FLAVORS["debug"].vocab_size
    samples = []
    for i, (num_prompt, num_completion) in enumerate([(10, 30), (6, 24), (8, 17), (4, 7)]):
        tokens = torch.randint(1, vocab, (num_prompt + num_completion,), generator=gen).tolist()
        samples.append(Sample(tokens[:num_prompt], tokens[num_prompt:], [0.0] * num_completion, advantage=1.0 + i))
    (row,) = pack(samples, seq_len=128, num_ranks=1)[0]
    assert row.batch_size == torch.Size([1, 106])
    return row


def _nll(model, mb, attn, num_loss_tokens):
    logits = model(mb["input_ids"], mb["position_ids"], attn)  # (1, T, V)
    logprobs, _ = losses.token_logprobs(logits, mb["targets"], temperature=1.0)
    return losses.sft_loss(logprobs, mb["loss_mask"], num_loss_tokens), logprobs


def _cp_matches_whole_row(rank, world_size):
    row = _row()
    num_loss_tokens = int(row["loss_mask"].sum())

    ref_model = _model()
    ref_loss, ref_logprobs = _nll(ref_model, row, DocumentCausalAttention(row["doc_ids"]), num_loss_tokens)
    ref_loss.backward()

    model = _model()
    padded = pad_for_cp(row, world_size)
    local, local_index = cp_split(padded, rank, world_size)
    attn = ContextParallelAttention(padded["doc_ids"], local_index, group=None)
    loss, logprobs = _nll(model, local, attn, num_loss_tokens)
    loss.backward()

    total = loss.detach().clone()
    dist.all_reduce(total)
    torch.testing.assert_close(total, ref_loss.detach(), rtol=1e-5, atol=1e-6)

    # Every rank's logprobs, put back in row order, are the whole-row logprobs.
    pieces = [torch.empty_like(logprobs.detach()) for _ in range(world_size)]
    indices = [torch.empty_like(local_index) for _ in range(world_size)]
    dist.all_gather(pieces, logprobs.detach().contiguous())
    dist.all_gather(indices, local_index)
    full = torch.empty(1, padded.batch_size[1])
    full[:, torch.cat(indices)] = torch.cat(pieces, dim=1)
    torch.testing.assert_close(full[:, :row.batch_size[1]], ref_logprobs.detach(), rtol=1e-5, atol=1e-5)

    # cp ranks' gradients summed = the single-process gradient of the whole row.
    for (name, p), ref_p in zip(model.named_parameters(), ref_model.parameters()):
        dist.all_reduce(p.grad)
        torch.testing.assert_close(p.grad, ref_p.grad, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.heavy)])
def test_context_parallel_matches_single_process(world_size):
    run_ranks(_cp_matches_whole_row, world_size)
