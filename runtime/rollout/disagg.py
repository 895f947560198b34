"""The controller's side of prefill/decode disaggregation (inference.prefill_ranks = K > 0).

Routing. Every episode has a *home*: the decode replica picked for its group when the group is
dispatched, the one with the fewest episodes in flight homed there (ties: the lowest rank), so a
group shares one decode replica's prefix cache. An episode's first turn goes to a prefill replica,
the one with the fewest prompt tokens outstanding (sent, not yet handed off or finished), in a
GENERATE whose meta `decode` names the home; every later turn of the episode goes straight to its
home, whose prefix cache holds the earlier turns, and is prefilled there (only the new tokens).

Handoffs. A prefill replica reports each batch of prefilled sequences as PREFILLED; the controller
relays it in one handler: SEND_KV to the prefill replica, RECV_KV (the same data, with the sender)
to the decode replica. LOAD_WEIGHTS goes to every inference rank in one handler too, so every
rank sees transfers and weight broadcasts in the controller's one order and none waits on another
(runtime/engine/disagg.py).
"""

from __future__ import annotations

from typing import Any

from meshrl.runtime import protocol, transport
from meshrl.runtime.layout import Layout
from meshrl.runtime.transport import Message


class DisaggRouter:
    """Balances the prefill and decode pools and relays handoffs (module docstring).

    where: the controller's request id -> episode key map (runtime/rollout/episodes.py's TurnRouter).
    """

    def __init__(self, layout: Layout, where: dict[int, Any]) -> None:
        self.layout, self.where = layout, where
        self.prefill_load = dict.fromkeys(layout.roles.prefill_engines, 0)  # prompt tokens outstanding
        self.decode_load = dict.fromkeys(layout.roles.decode_engines, 0)  # episodes in flight homed there
        self.home_of: dict[Any, int] = {}  # episode key -> its decode replica (training episodes)
        self.begun: set[Any] = set()  # episodes whose first turn went out
        self.prefilling: dict[int, tuple[int, int]] = {}  # request id -> (prefill rank, prompt tokens)

    def home(self, keys: list[Any]) -> int:
        """The decode replica of a new group's episodes: the least loaded."""
        rank = min(self.decode_load, key=lambda r: (self.decode_load[r], r))
        self.decode_load[rank] += len(keys)
        self.home_of.update(dict.fromkeys(keys, rank))
        return rank

    def episode_done(self, key: Any) -> None:
        self.begun.discard(key)
        rank = self.home_of.pop(key, None)
        if rank is not None:
            self.decode_load[rank] -= 1

    def send(self, rank: int, sampling: dict, ids: list[int], prompts: list[list[int]], seeds: list[int]) -> None:
        """Requests whose episodes live on decode replica `rank`: first turns through a prefill replica."""
        first = [self.where[rid] not in self.begun for rid in ids]
        self.begun.update(self.where[rid] for rid in ids)
        later = [i for i, f in enumerate(first) if not f]
        new = [i for i, f in enumerate(first) if f]
        if later:
            self._generate(rank, sampling, ids, prompts, seeds, later, None)
        if new:
            prefill = min(self.prefill_load, key=lambda r: (self.prefill_load[r], r))
            for i in new:
                self.prefilling[ids[i]] = (prefill, len(prompts[i]))
                self.prefill_load[prefill] += len(prompts[i])
            self._generate(prefill, sampling, ids, prompts, seeds, new, rank)

    def _generate(self, dst: int, sampling: dict, ids, prompts, seeds, pick: list[int], decode: int | None) -> None:
        msg = protocol.generate([ids[i] for i in pick], [prompts[i] for i in pick], [seeds[i] for i in pick],
                                sampling, decode)
        transport.send(msg, dst, self.layout.down[dst])

    def on_prefilled(self, msg: Message) -> None:
        """Relay a handoff: the prefill replica sends its blocks, the decode replica takes them."""
        self._settle(msg.data["request_id"].tolist())
        transport.send(protocol.send_kv(msg.meta["handoff"]), msg.src, self.layout.down[msg.src])
        dst = msg.meta["dst"]
        transport.send(protocol.recv_kv(msg), dst, self.layout.down[dst])

    def on_completions(self, request_ids: list[int]) -> None:
        """Turns that finished (on a prefill replica: at their first token) leave the prefill load."""
        self._settle(request_ids)

    def _settle(self, request_ids: list[int]) -> None:
        for rid in request_ids:
            entry = self.prefilling.pop(rid, None)
            if entry is not None:
                self.prefill_load[entry[0]] -= entry[1]
