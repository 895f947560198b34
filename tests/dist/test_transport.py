import torch
import torch.distributed as dist
from tensordict import TensorDict

from meshrl.runtime import transport
from tests.dist.multirank import run_ranks


def _ragged(n: int) -> TensorDict:
    lens = torch.arange(1, n + 1)
    return TensorDict(
        {"lens": lens, "tokens": torch.arange(int(lens.sum())), "logprobs": -torch.rand(int(lens.sum())),
         "mb": {"x": torch.ones(2, 3, dtype=torch.bfloat16), "mask": torch.tensor([True, False])}},
        batch_size=[],
    )


def _exchange(rank, world_size):
    g = dist.new_group([0, 1], backend="gloo")
    if rank == 0:
        for n in (1, 5, 17):
            transport.send(transport.Message("batch", {"n": n}, _ragged(n)), dst=1, group=g)
        transport.send(transport.Message("stop"), dst=1, group=g)
    else:
        inbox = transport.Inbox()
        inbox.listen(0, g, "rank0")
        for n in (1, 5, 17):
            msg = inbox.get(timeout=30)
            assert msg.kind == "batch" and msg.meta == {"n": n} and msg.src == 0
            ref = _ragged(n)
            for key in ("lens", "tokens"):
                assert torch.equal(msg.data[key], ref[key])
            assert msg.data["logprobs"].shape == ref["logprobs"].shape
            assert msg.data["mb", "x"].dtype == torch.bfloat16 and msg.data["mb", "mask"].tolist() == [True, False]
        assert inbox.get(timeout=30).kind == "stop"
        assert inbox.get(timeout=0) is None


def test_ragged_tensordicts_cross_ranks():
    run_ranks(_exchange, 2)


def _outbox(rank, world_size):
    g = dist.new_group([0, 1], backend="gloo")
    if rank == 0:
        outbox = transport.Outbox(1, g, "rank1")
        for n in range(1, 30):  # queued faster than rank 1 takes them: they leave in order
            outbox.send(transport.Message("batch", {"n": n}, _ragged(n % 5 + 1)))
        outbox.send(transport.Message("stop"))
        outbox.close()
    else:
        inbox = transport.Inbox()
        inbox.listen(0, g, "rank0")
        got = []
        while (msg := inbox.get(timeout=30)).kind != "stop":
            got.append(msg.meta["n"])
            assert msg.data["lens"].tolist() == list(range(1, msg.meta["n"] % 5 + 2))
        assert got == list(range(1, 30))


def test_outbox_sends_in_order_from_its_thread():
    run_ranks(_outbox, 2)
