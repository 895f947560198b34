"""Pack scored rollouts into one-row micro-batches for each trainer data-parallel rank.

A *document* is one sample's prompt followed by its completion. Documents are never split:
each micro-batch is a single row ``(1, T)`` with ``T <= seq_len`` holding several whole
documents back to back, and ``doc_ids`` / ``position_ids`` let attention keep them apart
(token i attends token j iff same document and j <= i) and restart RoPE per document.

For a document with ``P`` prompt and ``C`` completion tokens at row offset ``o``:

    position      o .. o+P-2 | o+P-1 .. o+P+C-2 | o+P+C-1
    target        prompt[1:] | completion       | 0 (no next token in this document)
    loss_mask     False      | True             | False

so the loss positions are exactly those whose target is a completion token, and
``inference_logprobs`` there is the engine's logprob of that target token.

Multi-turn samples. The completion of a multi-turn episode interleaves sampled tokens with
environment tokens (tool results, feedback, the next user message), in the order the engine
saw them. ``Sample.completion_mask`` is True on sampled tokens and False on environment
tokens; a position is a loss position only if its target is a *sampled* completion token, so
environment tokens are context and never trained on. ``completion_logprobs`` still has one
value per completion token (the value at an environment token is ignored). Without a mask
every completion token is sampled, as above.

Shared prompts (``share_prompts=True``). The samples of a GRPO group repeat one prompt; packed as
above, every sample's copy of it is computed again. With sharing, samples whose prompts have the
same token ids (``P >= 2`` tokens, two or more samples) are packed as one *unit*: a prompt document
``prompt[:-1]`` (positions 0 .. P-2, no loss), then one *branch* document per sample,
``[prompt[-1]] + completion`` at positions P-1 .. P+C-1, whose targets and loss are those of the
unshared document above (the last prompt token is repeated in each branch because it predicts that
sample's first completion token). ``prompt_doc`` marks the branches: 1 + the doc id of the prompt
document they also attend in full (0 elsewhere), so token i attends token j iff (same document and
j <= i) or j lies in i's prompt document (runtime/train/shared_prompt.py). The prompt's keys and
values are those of every unshared copy, so the logprobs, the loss and the gradients are those of
the unshared packing, from P - 1 fewer tokens per sample. A unit that would exceed ``seq_len`` is
cut into several units, each with its own copy of the prompt; no unit is ever split between rows
or ranks, so data sharding never separates a branch from its prompt.

Bins are filled first-fit-decreasing by document length, then handed to ranks greedily
(largest bin to the least-loaded rank). Every rank gets the same number of micro-batches
because FSDP's collectives must match across ranks: short ranks are padded with length-1
micro-batches that carry no loss tokens. The result is deterministic for a given input. (With shared
prompts, read "unit" for "document": a unit is one document or one prompt with its branches.)
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from tensordict import TensorDict

__all__ = ["Sample", "pack", "pack_sft", "count_loss_tokens", "shared_fraction"]


@dataclass
class Sample:
    """One scored rollout, token ids as the engine saw them."""

    prompt_ids: list[int]
    completion_ids: list[int]
    completion_logprobs: list[float]  # one per completion token, from the inference engine
    advantage: float
    completion_mask: list[bool] | None = None  # True: sampled (trained); False: environment token


def pack(samples: Sequence[Sample], seq_len: int, num_ranks: int, pad_id: int = 0,
         share_prompts: bool = False) -> list[list[TensorDict]]:
    """Pack samples into ``num_ranks`` equally long lists of one-row micro-batches.

    Args:
        samples: scored rollouts; a sample's index in this sequence is its ``sample_ids`` value.
        seq_len: maximum tokens per micro-batch row; a longer document raises ValueError.
        num_ranks: trainer data-parallel ranks.
        pad_id: token id of the padding micro-batches.
        share_prompts: pack the samples of one prompt on one copy of it (the module docstring).

    Returns:
        ``batches[rank][i]``: TensorDict, batch_size (1, T), with int64 ``input_ids``,
        ``position_ids``, ``doc_ids`` (0, 1, .. within the row), ``prompt_doc`` (0, or 1 + the doc
        id of the shared prompt a branch attends), ``targets``, ``sample_ids`` (-1 in padding
        micro-batches; a shared prompt's tokens carry its first sample's), bool ``loss_mask``, fp32
        ``advantages`` and ``inference_logprobs`` (both 0 outside the loss mask).
    """
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    if num_ranks < 1:
        raise ValueError(f"num_ranks must be >= 1, got {num_ranks}")
    doc_lengths = [_document_length(i, s, seq_len) for i, s in enumerate(samples)]
    units = _shared_units(samples, seq_len) if share_prompts else [(i,) for i in range(len(samples))]
    lengths = [_unit_length(samples, unit) for unit in units]
    assert sum(doc_lengths) >= sum(lengths)
    bins = [[units[u] for u in b] for b in _first_fit_decreasing(lengths, seq_len)]
    per_rank = _assign_to_ranks(bins, [sum(_unit_length(samples, u) for u in b) for b in bins], num_ranks)
    num_micro_batches = max(len(rank_bins) for rank_bins in per_rank)
    return [
        [_build_row(samples, row_units) for row_units in rank_bins]
        + [_empty_row(pad_id) for _ in range(num_micro_batches - len(rank_bins))]
        for rank_bins in per_rank
    ]


def pack_sft(
    examples: Sequence[tuple[list[int], list[int]] | tuple[list[int], list[int], list[bool]]], seq_len: int,
    num_ranks: int, pad_id: int = 0
) -> list[list[TensorDict]]:
    """`pack` for supervised training: (prompt_ids, completion_ids) pairs, or triples with a completion
    mask (True: a trained token; a chat's user turns are False), advantage 1, logprobs 0."""
    samples = [
        Sample(list(ex[0]), list(ex[1]), [0.0] * len(ex[1]), advantage=1.0,
               completion_mask=list(ex[2]) if len(ex) > 2 else None)
        for ex in examples
    ]
    return pack(samples, seq_len, num_ranks, pad_id=pad_id)


def count_loss_tokens(batches: Sequence[Sequence[TensorDict]]) -> int:
    """Loss tokens over all ranks and micro-batches (the ``num_loss_tokens`` of the losses)."""
    return sum(int(mb["loss_mask"].sum()) for rank_batches in batches for mb in rank_batches)


def shared_fraction(samples: Sequence[Sample], batches: Sequence[Sequence[TensorDict]]) -> float:
    """The fraction of the unshared packing's tokens (prompt + completion per sample) that `batches`
    does without (0 for unshared packing; padding micro-batches do not count)."""
    unshared = sum(len(s.prompt_ids) + len(s.completion_ids) for s in samples)
    packed = sum(int(mb["input_ids"].shape[1]) for r in batches for mb in r if int(mb["sample_ids"].max()) >= 0)
    return 1.0 - packed / max(unshared, 1)


def _document_length(index: int, sample: Sample, seq_len: int) -> int:
    """Validate one sample and return its document length (prompt + completion)."""
    if len(sample.prompt_ids) == 0:
        raise ValueError(f"sample {index}: empty prompt (a prompt token must predict the first completion token)")
    if len(sample.completion_logprobs) != len(sample.completion_ids):
        raise ValueError(
            f"sample {index}: {len(sample.completion_ids)} completion tokens but "
            f"{len(sample.completion_logprobs)} completion logprobs"
        )
    if sample.completion_mask is not None and len(sample.completion_mask) != len(sample.completion_ids):
        raise ValueError(
            f"sample {index}: {len(sample.completion_ids)} completion tokens but "
            f"{len(sample.completion_mask)} completion mask values"
        )
    length = len(sample.prompt_ids) + len(sample.completion_ids)
    if length > seq_len:
        raise ValueError(f"sample {index}: document of {length} tokens does not fit seq_len={seq_len}")
    return length


def _first_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Bins of document indices, longest documents placed first into the first bin with room."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    free: list[int] = []
    for i in order:
        slot = next((b for b, room in enumerate(free) if room >= lengths[i]), None)
        if slot is None:
            bins.append([])
            free.append(capacity)
            slot = len(bins) - 1
        bins[slot].append(i)
        free[slot] -= lengths[i]
    return bins


def _shared_units(samples: Sequence[Sample], seq_len: int) -> list[tuple[int, ...]]:
    """Sample indices grouped by identical prompt (first-seen order), each group cut into units of at
    most `seq_len` tokens. A unit of one sample is a plain document."""
    groups: dict[tuple, list[int]] = {}
    for i, s in enumerate(samples):
        groups.setdefault(tuple(s.prompt_ids) if len(s.prompt_ids) >= 2 else ("single", i), []).append(i)
    cap = seq_len
    units: list[tuple[int, ...]] = []
    for group in groups.values():
        unit: list[int] = []
        for i in group:
            if unit and _unit_length(samples, (*unit, i)) > cap:
                units.append(tuple(unit))
                unit = []
            unit.append(i)
        units.append(tuple(unit))
    return units


def _unit_length(samples: Sequence[Sample], unit: tuple[int, ...]) -> int:
    """Tokens of a unit: one document, or a shared prompt (P - 1 tokens) and one 1 + C branch per sample."""
    if len(unit) == 1:
        s = samples[unit[0]]
        return len(s.prompt_ids) + len(s.completion_ids)
    return len(samples[unit[0]].prompt_ids) - 1 + sum(1 + len(samples[i].completion_ids) for i in unit)


def _assign_to_ranks(bins: list[list], sizes: list[int], num_ranks: int) -> list[list[list]]:
    """Greedy balance of token counts: each bin, largest first, goes to the least-loaded rank."""
    order = sorted(range(len(bins)), key=lambda b: (-sizes[b], b))
    per_rank: list[list[list]] = [[] for _ in range(num_ranks)]
    load = [0] * num_ranks
    for b in order:
        rank = min(range(num_ranks), key=lambda r: (load[r], r))
        per_rank[rank].append(bins[b])
        load[rank] += sizes[b]
    return per_rank


def _build_row(samples: Sequence[Sample], units: list[tuple[int, ...]]) -> TensorDict:
    """One (1, T) micro-batch holding the given units (documents, or shared prompts with their branches)."""
    columns: dict[str, list] = {k: [] for k in _FIELDS}

    def add(values: dict[str, list]) -> None:
        for key, v in values.items():
            columns[key].extend(v)

    doc_id = 0
    for unit in units:
        if len(unit) == 1:
            add(_document_columns(samples[unit[0]], doc_id, unit[0]))
            doc_id += 1
            continue
        prompt_doc, prompt = doc_id, list(samples[unit[0]].prompt_ids)
        n = len(prompt) - 1  # the shared prompt document: prompt[:-1], targets prompt[1:], no loss
        add({"input_ids": prompt[:-1], "position_ids": list(range(n)), "doc_ids": [prompt_doc] * n,
             "prompt_doc": [0] * n, "sample_ids": [unit[0]] * n, "targets": prompt[1:], "loss_mask": [False] * n,
             "advantages": [0.0] * n, "inference_logprobs": [0.0] * n})
        for index in unit:
            doc_id += 1
            s = samples[index]
            branch = Sample(s.prompt_ids[-1:], s.completion_ids, s.completion_logprobs, s.advantage, s.completion_mask)
            add(_document_columns(branch, doc_id, index, start=len(s.prompt_ids) - 1, prompt_doc=prompt_doc + 1))
        doc_id += 1
    return _to_tensordict(columns)


def _document_columns(sample: Sample, doc_id: int, sample_index: int, start: int = 0,
                      prompt_doc: int = 0) -> dict[str, list]:
    """Per-position values of one document (see the module docstring for the layout); a shared
    prompt's branch (its prompt is the last prompt token) starts at position `start`, with `prompt_doc`."""
    num_prompt = len(sample.prompt_ids)
    tokens = list(sample.prompt_ids) + list(sample.completion_ids)
    length = len(tokens)
    # Position t predicts tokens[t + 1]; it is a loss position iff that token is a sampled completion token.
    sampled = sample.completion_mask if sample.completion_mask is not None else [True] * len(sample.completion_ids)
    is_loss = [num_prompt - 1 <= t <= length - 2 and bool(sampled[t + 1 - num_prompt]) for t in range(length)]
    return {
        "input_ids": tokens,
        "position_ids": list(range(start, start + length)),
        "doc_ids": [doc_id] * length,
        "prompt_doc": [prompt_doc] * length,
        "sample_ids": [sample_index] * length,
        "targets": tokens[1:] + [0],
        "loss_mask": is_loss,
        "advantages": [float(sample.advantage) if m else 0.0 for m in is_loss],
        "inference_logprobs": [0.0] * (num_prompt - 1)
        + [float(lp) if m else 0.0 for lp, m in zip(sample.completion_logprobs, sampled)] + [0.0],
    }


def _empty_row(pad_id: int) -> TensorDict:
    """A length-1 micro-batch with no loss tokens, so every rank runs the same collectives."""
    return _to_tensordict(
        {
            "input_ids": [pad_id],
            "position_ids": [0],
            "doc_ids": [0],
            "prompt_doc": [0],
            "sample_ids": [-1],
            "targets": [0],
            "loss_mask": [False],
            "advantages": [0.0],
            "inference_logprobs": [0.0],
        }
    )


_FIELDS = {
    "input_ids": torch.int64,
    "position_ids": torch.int64,
    "doc_ids": torch.int64,
    "prompt_doc": torch.int64,
    "sample_ids": torch.int64,
    "targets": torch.int64,
    "loss_mask": torch.bool,
    "advantages": torch.float32,
    "inference_logprobs": torch.float32,
}


def _to_tensordict(columns: dict[str, list]) -> TensorDict:
    """Lists of per-position values -> (1, T) tensors of the field dtypes."""
    length = len(columns["input_ids"])
    tensors = {key: torch.tensor(columns[key], dtype=dtype).view(1, length) for key, dtype in _FIELDS.items()}
    return TensorDict(tensors, batch_size=[1, length])
