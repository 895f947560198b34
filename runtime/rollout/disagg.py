"""The controller's side of prefill/decode disaggregation (inference.prefill_ranks = K > 0).

Routing. Every episode has a *home*: the decode replica picked for its group when the group is
dispatched, the one with the fewest episodes in flight homed there (ties: the lowest rank), so a
group shares one decode replica's prefix cache. Every later turn of an episode goes straight to its
home, whose prefix cache holds the earlier turns, and is prefilled there (only the new tokens).

First turns. Each distinct prompt of a batch (a group's samples are identical prompts and stay
together, so they are prefilled once and forked) goes to the prefill replica with the fewest prompt
tokens outstanding (sent, not yet handed off or finished; a distinct prompt counts once), in a
GENERATE whose meta `decode` names the home. Unless that replica already has `backlog_tokens` or
more outstanding: then the prefill pool is the bottleneck (long prompts, many groups at once) and
the prompt goes straight to its home decode replica, which prefills it itself, as it prefills
continuations. So the decode pool does not sit idle behind a long prefill queue, and a prefill
replica is never idle while a decode replica prefills a first turn. Completions are the same either
way (seeds travel with the requests).

Handoffs. A prefill replica reports each batch of prefilled sequences as PREFILLED; the controller
relays it in one handler: SEND_KV to the prefill replica, RECV_KV (the same data, with the sender)
to the decode replica. LOAD_WEIGHTS goes to every inference rank in one handler too, so every
rank sees transfers and weight broadcasts in the controller's one order and none waits on another
(runtime/engine/disagg.py).

Aborts (`abort`). ABORT goes to the request's decode replica and, while the request may still be on
its prefill replica (not handed off, not finished), to that one first. Each channel is ordered, so a
prefill replica sees the ABORT before the SEND_KV of any handoff that holds the request, and a decode
replica sees it after the RECV_KV of any handoff relayed before the abort. A handoff relayed after
the abort carries the request in RECV_KV's `drop`: the decode replica does not take it and its blocks
are not sent; the prefill replica reports it aborted. Every sample is reported once, by the replica
that held it, as one engine's `abort` would report it. Requests are one sample each (as the
controller sends them).
"""

from __future__ import annotations

from typing import Any

from meshrl.runtime import protocol, transport
from meshrl.runtime.layout import Layout
from meshrl.runtime.transport import Message


class DisaggRouter:
    """Balances the prefill and decode pools, relays handoffs and aborts (module docstring).

    where: the controller's request id -> episode key map (runtime/rollout/episodes.py's TurnRouter).
    backlog_tokens: prompt tokens outstanding on the least loaded prefill replica from which first
    turns are prefilled by their decode replica instead (inference.prefill_backlog_tokens).
    """

    def __init__(self, layout: Layout, where: dict[int, Any], backlog_tokens: int) -> None:
        self.layout, self.where, self.backlog_tokens = layout, where, backlog_tokens
        self.prefill_load = dict.fromkeys(layout.roles.prefill_engines, 0)  # prompt tokens outstanding
        self.decode_load = dict.fromkeys(layout.roles.decode_engines, 0)  # episodes in flight homed there
        self.home_of: dict[Any, int] = {}  # episode key -> its decode replica (training episodes)
        self.begun: set[Any] = set()  # episodes whose first turn went out
        self.prefilling: dict[int, tuple[int, int]] = {}  # request id -> (prefill rank, prompt tokens counted)
        self.decode_of: dict[int, int] = {}  # request id in flight -> its decode replica
        self.aborted: set[int] = set()  # aborted while on a prefill replica: dropped from a later handoff
        self.num_first_turns = {"prefill": 0, "decode": 0}
        """First turns sent through a prefill replica / prefilled by their decode replica (backlog)."""

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
        """Requests whose episodes live on decode replica `rank` (first turns: module docstring)."""
        assert sampling.get("n", 1) == 1, "the router tracks requests of one sample"
        first = [self.where[rid] not in self.begun for rid in ids]
        self.begun.update(self.where[rid] for rid in ids)
        self.decode_of.update(dict.fromkeys(ids, rank))
        direct = [i for i, f in enumerate(first) if not f]  # prefilled by the decode replica itself
        to_prefill: dict[int, list[int]] = {}
        by_prompt: dict[tuple[int, ...], list[int]] = {}
        for i in (i for i, f in enumerate(first) if f):
            by_prompt.setdefault(tuple(prompts[i]), []).append(i)
        for prompt, same in by_prompt.items():
            prefill = min(self.prefill_load, key=lambda r: (self.prefill_load[r], r))
            kind = "decode" if self.prefill_load[prefill] >= self.backlog_tokens else "prefill"
            self.num_first_turns[kind] += len(same)
            if kind == "decode":
                direct += same
                continue
            to_prefill.setdefault(prefill, []).extend(same)
            self.prefill_load[prefill] += len(prompt)
            for n, i in enumerate(same):  # the prompt is prefilled once: counted on its first request
                self.prefilling[ids[i]] = (prefill, len(prompt) if n == 0 else 0)
        if direct:
            self._generate(rank, sampling, ids, prompts, seeds, sorted(direct), None)
        for prefill, pick in to_prefill.items():
            self._generate(prefill, sampling, ids, prompts, seeds, pick, rank)

    def _generate(self, dst: int, sampling: dict, ids, prompts, seeds, pick: list[int], decode: int | None) -> None:
        msg = protocol.generate([ids[i] for i in pick], [prompts[i] for i in pick], [seeds[i] for i in pick],
                                sampling, decode)
        transport.send(msg, dst, self.layout.down[dst])

    def on_prefilled(self, msg: Message) -> None:
        """Relay a handoff: the prefill replica sends its blocks, the decode replica takes them (less
        the requests aborted meanwhile)."""
        ids = msg.data["request_id"].tolist()
        drop = self.aborted.intersection(ids)
        self.aborted -= drop
        self._settle(ids)
        transport.send(protocol.send_kv(msg.meta["handoff"]), msg.src, self.layout.down[msg.src])
        dst = msg.meta["dst"]
        transport.send(protocol.recv_kv(msg, drop), dst, self.layout.down[dst])

    def on_completions(self, request_ids: list[int]) -> None:
        """Turns that finished (on a prefill replica: at their first token, or aborted there)."""
        self._settle(request_ids)
        for rid in request_ids:
            self.decode_of.pop(rid, None)
            self.aborted.discard(rid)

    def abort(self, request_ids: list[int]) -> None:
        """End requests in flight wherever they are (module docstring); their abort completions come
        back as COMPLETIONS. Requests that are not in flight are ignored."""
        by_rank: dict[int, list[int]] = {}
        for rid in request_ids:
            if rid not in self.decode_of:
                continue
            if rid in self.prefilling:
                self.aborted.add(rid)
                by_rank.setdefault(self.prefilling[rid][0], []).append(rid)
            by_rank.setdefault(self.decode_of[rid], []).append(rid)
        for rank, rids in by_rank.items():
            transport.send(protocol.abort(rids), rank, self.layout.down[rank])

    def _settle(self, request_ids: list[int]) -> None:
        for rid in request_ids:
            entry = self.prefilling.pop(rid, None)
            if entry is not None:
                self.prefill_load[entry[0]] -= entry[1]
