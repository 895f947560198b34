import pytest
import torch
from tensordict import TensorDict

from meshrl.parallel.context_parallel import cp_local_index, cp_split, pad_for_cp
from meshrl.runtime.train.packing import Sample, pack


def _row() -> TensorDict:
    """One packed row of 4 documents, 37 tokens (not a multiple of 4 or 8)."""
    samples = [Sample(list(range(1, 1 + p)), list(range(50, 50 + c)), [-0.5] * c, advantage=1.0 + i)
               for i, (p, c) in enumerate([(5, 9), (3, 6), (7, 4), (2, 1)])]
    (row,) = pack(samples, seq_len=64, num_ranks=1)[0]
    assert row.batch_size == torch.Size([1, 37])
    return row


@pytest.mark.parametrize("cp_size", [1, 2, 3, 4])
def test_pad_then_split_round_trips(cp_size):
    row = _row()
    padded = pad_for_cp(row, cp_size, pad_id=7)
    T = padded.batch_size[1]
    assert T % (2 * cp_size) == 0 and 37 <= T < 37 + 2 * cp_size
    pieces = [cp_split(padded, r, cp_size) for r in range(cp_size)]
    index = torch.cat([idx for _, idx in pieces])
    order = index.argsort()
    assert torch.equal(index[order], torch.arange(T))
    for key in row.keys():
        local = torch.cat([piece[key] for piece, _ in pieces], dim=1)  # (1, T) in rank order
        assert torch.equal(local[:, order], padded[key])
        assert torch.equal(padded[key][:, :37], row[key])
    for piece, idx in pieces:
        assert isinstance(piece, TensorDict) and piece.batch_size == torch.Size([1, T // cp_size])
        assert torch.equal(idx, idx.sort().values)


def test_padding_is_inert():
    row = _row()
    padded = pad_for_cp(row, 4, pad_id=7)  # 37 -> 40
    tail = padded[:, 37:]
    assert tail["input_ids"].eq(7).all() and tail["position_ids"].eq(0).all() and tail["targets"].eq(0).all()
    assert not tail["loss_mask"].any() and tail["sample_ids"].eq(-1).all()
    assert tail["advantages"].eq(0).all() and tail["inference_logprobs"].eq(0).all()
    assert tail["doc_ids"].eq(int(row["doc_ids"].max()) + 1).all()  # one new document
    assert padded["loss_mask"].sum() == row["loss_mask"].sum()
    for key in row.keys():
        assert padded[key].dtype == row[key].dtype
    assert pad_for_cp(padded, 2) is padded  # already a multiple of 4


def test_plain_dicts_are_supported():
    mb = {"input_ids": torch.arange(6).view(1, 6), "doc_ids": torch.zeros(1, 6, dtype=torch.long)}
    padded = pad_for_cp(mb, 2)
    assert isinstance(padded, dict) and padded["input_ids"].tolist() == [[0, 1, 2, 3, 4, 5, 0, 0]]
    assert padded["doc_ids"].tolist() == [[0] * 6 + [1, 1]]
    local, index = cp_split(padded, 1, 2)
    assert index.tolist() == [2, 3, 4, 5] and local["input_ids"].tolist() == [[2, 3, 4, 5]]


@pytest.mark.parametrize("cp_size", [2, 3, 4, 8])
def test_split_balances_causal_work(cp_size):
    T = 2 * cp_size * 5
    shares = [cp_local_index(T, r, cp_size) for r in range(cp_size)]
    # Causal work of query t is t + 1 keys: every rank gets exactly the same total.
    work = {int((idx + 1).sum()) for idx in shares}
    assert len(work) == 1
    assert cp_local_index(16, 0, 4).tolist() == [0, 1, 14, 15]
    assert cp_local_index(16, 3, 4).tolist() == [6, 7, 8, 9]


def test_user_mistakes_raise():
    with pytest.raises(ValueError, match="multiple of 2 \\* cp_size"):
        cp_split({"input_ids": torch.zeros(1, 6, dtype=torch.long)}, 0, 2)
    with pytest.raises(ValueError, match="cp_rank"):
        cp_local_index(8, 2, 2)
    with pytest.raises(ValueError, match="cp_size"):
        pad_for_cp({"input_ids": torch.zeros(1, 6)}, 0)
    with pytest.raises(ValueError, match="\\(1, T\\)"):
        pad_for_cp({"input_ids": torch.zeros(2, 6)}, 2)
    with pytest.raises(ValueError, match="different lengths"):
        pad_for_cp({"a": torch.zeros(1, 6), "b": torch.zeros(1, 5)}, 2)
