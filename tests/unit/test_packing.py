"""Packing of rollouts into one-row micro-batches per rank."""

import random
from collections import Counter

import pytest
import torch

from meshrl.runtime.train.packing import Sample, count_loss_tokens, pack, pack_sft

FIELDS = {
    "input_ids", "position_ids", "doc_ids", "prompt_doc", "sample_ids", "targets", "loss_mask", "advantages", "inference_logprobs"
}


def _random_samples(num: int, seed: int = 0) -> list[Sample]:
    rng = random.Random(seed)
    samples = []
    for i in range(num):
        prompt = [rng.randrange(3, 100) for _ in range(rng.randint(1, 12))]
        completion = [rng.randrange(3, 100) for _ in range(rng.randint(0, 20))]
        logprobs = [-rng.random() for _ in completion]
        samples.append(Sample(prompt, completion, logprobs, advantage=rng.uniform(-1, 1)))
    return samples


def _micro_batches(batches):
    return [mb for rank_batches in batches for mb in rank_batches]


def test_hand_example_alignment():
    # Document 0: prompt [10, 11, 12], completion [20, 21]; document 1: prompt [30], completion [40].
    samples = [
        Sample([10, 11, 12], [20, 21], [-0.5, -0.25], advantage=2.0),
        Sample([30], [40], [-1.5], advantage=-1.0),
    ]
    [[mb]] = pack(samples, seq_len=16, num_ranks=1)
    assert mb.batch_size == torch.Size([1, 7]) and set(mb.keys()) == FIELDS
    assert mb["input_ids"].tolist() == [[10, 11, 12, 20, 21, 30, 40]]
    assert mb["position_ids"].tolist() == [[0, 1, 2, 3, 4, 0, 1]]
    assert mb["doc_ids"].tolist() == [[0, 0, 0, 0, 0, 1, 1]]
    assert mb["sample_ids"].tolist() == [[0, 0, 0, 0, 0, 1, 1]]
    assert mb["targets"].tolist() == [[11, 12, 20, 21, 0, 40, 0]]
    assert mb["loss_mask"].tolist() == [[False, False, True, True, False, True, False]]
    assert mb["advantages"].tolist() == [[0.0, 0.0, 2.0, 2.0, 0.0, -1.0, 0.0]]
    assert mb["inference_logprobs"].tolist() == [[0.0, 0.0, -0.5, -0.25, 0.0, -1.5, 0.0]]
    dtypes = {k: mb[k].dtype for k in FIELDS}
    assert dtypes["loss_mask"] == torch.bool
    assert dtypes["advantages"] == dtypes["inference_logprobs"] == torch.float32
    assert all(dtypes[k] == torch.int64 for k in FIELDS - {"loss_mask", "advantages", "inference_logprobs"})


@pytest.mark.parametrize("num_ranks", [1, 2, 3, 5])
def test_no_token_lost_or_duplicated_and_documents_whole(num_ranks):
    samples = _random_samples(40)
    seq_len = 48
    batches = pack(samples, seq_len=seq_len, num_ranks=num_ranks)
    seen = Counter()
    for mb in _micro_batches(batches):
        assert mb.batch_size[0] == 1 and mb.batch_size[1] <= seq_len
        sample_ids, doc_ids, positions = mb["sample_ids"][0], mb["doc_ids"][0], mb["position_ids"][0]
        for doc in doc_ids.unique().tolist():
            (where,) = (doc_ids == doc).nonzero(as_tuple=True)
            # A document is one contiguous run of its sample's tokens, complete from position 0.
            assert where.tolist() == list(range(where[0].item(), where[-1].item() + 1))
            (sample,) = sample_ids[where].unique().tolist()
            if sample < 0:
                continue
            s = samples[sample]
            assert positions[where].tolist() == list(range(len(s.prompt_ids) + len(s.completion_ids)))
            assert mb["input_ids"][0, where].tolist() == s.prompt_ids + s.completion_ids
        for sample, pos in zip(sample_ids.tolist(), positions.tolist()):
            if sample >= 0:
                seen[(sample, pos)] += 1
    expected = Counter((i, p) for i, s in enumerate(samples) for p in range(len(s.prompt_ids) + len(s.completion_ids)))
    assert seen == expected


def test_loss_tokens_match_completions():
    samples = _random_samples(30, seed=1)
    batches = pack(samples, seq_len=40, num_ranks=2)
    assert count_loss_tokens(batches) == sum(len(s.completion_ids) for s in samples)
    for mb in _micro_batches(batches):
        loss = mb["loss_mask"][0]
        # Outside the loss mask, advantages and logprobs are exactly zero.
        assert (mb["advantages"][0][~loss] == 0).all() and (mb["inference_logprobs"][0][~loss] == 0).all()
        for pos in loss.nonzero().flatten().tolist():
            s = samples[mb["sample_ids"][0, pos].item()]
            k = mb["position_ids"][0, pos].item() + 1 - len(s.prompt_ids)  # index of the target in the completion
            assert mb["targets"][0, pos].item() == s.completion_ids[k]
            assert mb["inference_logprobs"][0, pos].item() == pytest.approx(s.completion_logprobs[k])
            assert mb["advantages"][0, pos].item() == pytest.approx(s.advantage)


@pytest.mark.parametrize("num_ranks", [1, 2, 4, 7])
def test_every_rank_gets_the_same_number_of_micro_batches(num_ranks):
    batches = pack(_random_samples(9, seed=2), seq_len=32, num_ranks=num_ranks)
    assert len(batches) == num_ranks
    assert len({len(rank_batches) for rank_batches in batches}) == 1
    for rank_batches in batches:
        for mb in rank_batches:
            if (mb["sample_ids"] < 0).all():  # padding micro-batch
                assert mb.batch_size == torch.Size([1, 1]) and not mb["loss_mask"].any()


def test_ranks_are_balanced_by_tokens():
    samples = [Sample([1] * 10, [2] * 10, [0.0] * 10, 0.0) for _ in range(8)]  # 8 documents of 20 tokens
    batches = pack(samples, seq_len=40, num_ranks=2)
    tokens = [sum(mb.batch_size[1] for mb in rank_batches) for rank_batches in batches]
    assert tokens == [80, 80]


def test_deterministic():
    samples = _random_samples(25, seed=3)
    a, b = pack(samples, 50, 3), pack(samples, 50, 3)
    for rank_a, rank_b in zip(a, b):
        assert len(rank_a) == len(rank_b)
        for x, y in zip(rank_a, rank_b):
            assert all(torch.equal(x[k], y[k]) for k in FIELDS)


def test_too_long_document_raises_with_its_length():
    samples = [Sample([1, 2, 3], [4, 5, 6, 7], [0.0] * 4, 1.0)]
    with pytest.raises(ValueError, match="7 tokens"):
        pack(samples, seq_len=6, num_ranks=1)


def test_mismatched_logprobs_raise():
    with pytest.raises(ValueError, match="logprobs"):
        pack([Sample([1], [2, 3], [0.0], 1.0)], seq_len=8, num_ranks=1)


def test_document_mask_has_no_cross_document_pairs():
    for mb in _micro_batches(pack(_random_samples(30, seed=4), seq_len=64, num_ranks=2)):
        doc_ids, positions = mb["doc_ids"][0], mb["position_ids"][0]
        n = doc_ids.numel()
        i, j = torch.arange(n).view(n, 1), torch.arange(n).view(1, n)
        allowed = (doc_ids.view(n, 1) == doc_ids.view(1, n)) & (j <= i)  # (T, T) block-causal mask
        sample_ids = mb["sample_ids"][0]
        # Every allowed pair is within one sample, and every token sees exactly its own prefix.
        assert (sample_ids.view(n, 1) == sample_ids.view(1, n))[allowed].all()
        assert allowed.sum(dim=1).tolist() == (positions + 1).tolist()


def test_pack_sft():
    batches = pack_sft([([5, 6], [7, 8, 9]), ([5], [7])], seq_len=16, num_ranks=1)
    assert count_loss_tokens(batches) == 4
    [[mb]] = batches
    loss = mb["loss_mask"]
    assert (mb["advantages"][loss] == 1.0).all() and (mb["inference_logprobs"] == 0).all()
