"""Messages between ranks: a small JSON header plus a TensorDict, over torch.distributed.

Wire format of one message on a (src, dst) gloo pair group, three sends in order:

    sizes   int64 (2,)       = (header bytes, payload bytes)
    header  uint8 (h,)       = UTF-8 JSON: {"kind", "meta": {...}, "leaves": [[key, dtype, shape], ...]}
    payload uint8 (p,)       = the TensorDict's leaves, flattened and concatenated (CPU)

The receiver does not need to know shapes in advance (every rollout batch is ragged), and
the header is JSON, never pickle. Nested keys travel as "a.b" and come back nested.

`Inbox` runs a thread that receives messages from one peer and puts them on a queue, so a
rank can wait for "anything from anyone" with one `queue.get`, and an engine can poll
between decode steps without blocking. A receive error (a dead peer, a timeout) is put on
the queue too and raised by the consumer: it never dies silently in the thread.

`Outbox` is the other direction: a thread that sends one rank's messages to one peer in the
order they were queued, so that an engine does not wait, between two decode steps, for the
controller to take each batch of completions (three blocking sends each; on a loaded CPU
machine up to a fifth of a rollout's time went there). A send error is raised by the next
`send` or by `close`.
"""

from __future__ import annotations

import json
import queue
import threading
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from tensordict import TensorDict

_DTYPES = {str(d): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64,
                               torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)}


_ALIGN = 8


@dataclass
class Message:
    """One control or data message."""

    kind: str
    meta: dict[str, Any] = field(default_factory=dict)
    data: TensorDict | None = None
    src: int = -1


def _flatten(td: TensorDict) -> tuple[list[list[Any]], torch.Tensor]:
    leaves, chunks = [], []
    for key, value in td.items(include_nested=True, leaves_only=True):
        parts = key if isinstance(key, tuple) else (key,)
        if any("." in part for part in parts):
            raise ValueError(f"transport keys may not contain '.', got {parts}")
        name = ".".join(parts)
        t = value.detach().to("cpu").contiguous()
        leaves.append([name, str(t.dtype), list(t.shape)])
        raw = t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
        chunks.append(raw)
        if raw.numel() % _ALIGN:  # keep every leaf 8-byte aligned so the receiver can view it in place
            chunks.append(torch.zeros(_ALIGN - raw.numel() % _ALIGN, dtype=torch.uint8))
    payload = torch.cat(chunks) if chunks else torch.empty(0, dtype=torch.uint8)
    return leaves, payload


def _unflatten(leaves: list[list[Any]], payload: torch.Tensor, batch_size: list[int]) -> TensorDict:
    td = TensorDict({}, batch_size=[])
    offset = 0
    for name, dtype_name, shape in leaves:
        dtype = _DTYPES[dtype_name]
        numel = 1
        for s in shape:
            numel *= s
        nbytes = numel * dtype.itemsize
        t = payload[offset:offset + nbytes].view(dtype).reshape(shape)
        offset += nbytes + (-nbytes) % _ALIGN
        td.set(tuple(name.split(".")), t)
    assert offset == payload.numel(), "payload size does not match the header"
    if batch_size:
        td.batch_size = batch_size
    return td


def send(msg: Message, dst: int, group: dist.ProcessGroup) -> None:
    """Send `msg` to global rank `dst` on `group` (blocks until it is received)."""
    leaves, payload = _flatten(msg.data) if msg.data is not None else ([], torch.empty(0, dtype=torch.uint8))
    batch_size = list(msg.data.batch_size) if msg.data is not None else None
    header = json.dumps({"kind": msg.kind, "meta": msg.meta, "leaves": leaves, "batch_size": batch_size})
    hbytes = torch.frombuffer(bytearray(header.encode()), dtype=torch.uint8)
    dist.send(torch.tensor([hbytes.numel(), payload.numel()], dtype=torch.int64), dst=dst, group=group)
    dist.send(hbytes, dst=dst, group=group)
    if payload.numel():
        dist.send(payload, dst=dst, group=group)


def recv(src: int, group: dist.ProcessGroup) -> Message:
    """Receive one message from global rank `src` on `group` (blocks)."""
    sizes = torch.empty(2, dtype=torch.int64)
    dist.recv(sizes, src=src, group=group)
    hbytes = torch.empty(int(sizes[0]), dtype=torch.uint8)
    dist.recv(hbytes, src=src, group=group)
    header = json.loads(bytes(hbytes.numpy()).decode())
    data = None
    if header["batch_size"] is not None:
        payload = torch.empty(int(sizes[1]), dtype=torch.uint8)
        if payload.numel():
            dist.recv(payload, src=src, group=group)
        data = _unflatten(header["leaves"], payload, header["batch_size"])
    return Message(kind=header["kind"], meta=header["meta"], data=data, src=src)


class PeerError(RuntimeError):
    """Receiving from a peer failed (it died, or sent nothing within the timeout)."""


class Inbox:
    """Receive messages from several peers on background threads into one queue.

    Each (src, group) gets a daemon thread that loops on `recv` until it receives a message
    whose kind is in `last_kinds` (the peer's final message). `get` returns messages in
    arrival order and raises PeerError if a receiving thread failed.
    """

    def __init__(self, last_kinds: tuple[str, ...] = ("stop", "done")):  # protocol.Kind.STOP, DONE
        self.queue: queue.Queue[Message | BaseException] = queue.Queue()
        self.last_kinds = last_kinds
        self.threads: list[threading.Thread] = []

    def listen(self, src: int, group: dist.ProcessGroup, name: str) -> None:
        t = threading.Thread(target=self._loop, args=(src, group, name), daemon=True, name=f"inbox-{name}")
        t.start()
        self.threads.append(t)

    def _loop(self, src: int, group: dist.ProcessGroup, name: str) -> None:
        while True:
            try:
                msg = recv(src, group)
            except Exception as e:  # noqa: BLE001 - forwarded to the consumer, never swallowed
                err = PeerError(f"receiving from rank {src} ({name}) failed: {type(e).__name__}: {e}")
                err.__cause__ = e
                self.queue.put(err)
                return
            self.queue.put(msg)
            if msg.kind in self.last_kinds:
                return

    def get(self, timeout: float | None = None) -> Message | None:
        """Next message; None if `timeout` passed without one. Raises a receiving thread's error."""
        try:
            item = self.queue.get(timeout=timeout) if timeout != 0 else self.queue.get_nowait()
        except queue.Empty:
            return None
        if isinstance(item, BaseException):
            raise item
        return item

    def drain(self) -> list[Message]:
        """All messages waiting now, without blocking."""
        out = []
        while (msg := self.get(timeout=0)) is not None:
            out.append(msg)
        return out


class Outbox:
    """Send messages to one peer (dst, group) from a background thread, in queue order.

    `send` returns at once; `close` waits until everything queued is sent and ends the thread.
    The first send error is raised by the next `send` or `close` (never lost in the thread).
    """

    def __init__(self, dst: int, group: dist.ProcessGroup, name: str) -> None:
        self.dst, self.group = dst, group
        self.queue: queue.Queue[Message | None] = queue.Queue()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._loop, daemon=True, name=f"outbox-{name}")
        self.thread.start()

    def _loop(self) -> None:
        while (msg := self.queue.get()) is not None:
            try:
                send(msg, self.dst, self.group)
            except Exception as e:  # noqa: BLE001 - raised by the owner's next send / close
                self.error = PeerError(f"sending to rank {self.dst} failed: {type(e).__name__}: {e}")
                self.error.__cause__ = e
                return

    def _raise(self) -> None:
        if self.error is not None:
            raise self.error

    def send(self, msg: Message) -> None:
        self._raise()
        self.queue.put(msg)

    def close(self) -> None:
        """Send what is queued, stop the thread; raises a send error."""
        self.queue.put(None)
        self.thread.join()
        self._raise()
