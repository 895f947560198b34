"""Per-sequence recurrent state for linear-attention layers (Qwen3-Next / Qwen3.5's Gated DeltaNet).

A linear-attention layer keeps no per-token k/v: a sequence's whole past is a fixed-size state,
the conv's last K-1 inputs (C, K-1) and the delta rule's (Hv, Dk, Dv) matrix
(models/common/linear_attention.py). The engine keeps one slot of each per row, next to the paged
KV cache of the full-attention layers; a sequence's slot is its row, held from admission to
finish, so:

- a fresh prefill (no computed tokens: a new sequence, or one preempted and recomputed from its
  first token) starts from zero and overwrites the slot; a later prefill chunk and every decode
  step continue from it;
- a decode launch writes back only the rows it feeds (a real slot in the KV cache); pad rows, and
  rows of sequences still prefilling, keep their state;
- the delta-rule state is fp32 (the trainer computes the whole row in fp32), the conv state is in
  the model dtype (its inputs').

Prefix sharing (the prefix cache, and prefill-once forks of identical prompts) would let a
sequence skip tokens whose recurrent state nobody stored, so the engine turns it off for models
with linear-attention layers: every sample computes its own prompt, exactly.
"""

from __future__ import annotations

import torch
from torch import Tensor

from meshrl.runtime.engine.kv_cache import NULL_BLOCK, PagedAttention


class RecurrentStates:
    """State slots, one per row, of every linear-attention layer.

    shapes: layer id -> (conv state shape (C, K-1), delta-rule state shape (Hv, Dk, Dv)), as the
    engine's probe forward recorded them.
    """

    def __init__(self, shapes: dict[int, tuple[tuple[int, ...], tuple[int, ...]]], num_rows: int,
                 device: torch.device, dtype: torch.dtype) -> None:
        self.conv = {i: torch.zeros((num_rows, *c), dtype=dtype, device=device) for i, (c, _) in shapes.items()}
        self.state = {i: torch.zeros((num_rows, *s), dtype=torch.float32, device=device)
                      for i, (_, s) in shapes.items()}

    def release(self) -> int:
        """Free every slot's storage (a sleeping engine: runtime/engine/native.py `sleep`); returns
        the bytes freed. `restore` allocates the slots again, zeroed (no sequence is live then)."""
        freed = 0
        self._released = {}
        for kind in ("conv", "state"):
            slots = getattr(self, kind)
            for layer_id, t in slots.items():
                self._released[kind, layer_id] = (tuple(t.shape), t.dtype, t.device)
                freed += t.numel() * t.element_size()
                slots[layer_id] = t.new_empty(0)
        return freed

    @property
    def released(self) -> bool:
        """Whether `release` freed the storage and `restore` has not allocated it again."""
        return bool(getattr(self, "_released", None))

    def nbytes(self) -> int:
        """Bytes the slots hold now (0 while released)."""
        return sum(t.numel() * t.element_size() for slots in (self.conv, self.state) for t in slots.values())

    def restore(self) -> None:
        for (kind, layer_id), (shape, dtype, device) in self._released.items():
            getattr(self, kind)[layer_id] = torch.zeros(shape, dtype=dtype, device=device)
        self._released = {}

    @staticmethod
    def bytes_per_row(shapes: dict[int, tuple[tuple[int, ...], tuple[int, ...]]], dtype: torch.dtype) -> int:
        total = 0
        for conv, state in shapes.values():
            total += torch.Size(conv).numel() * dtype.itemsize + torch.Size(state).numel() * 4
        return total

    def run(self, layer_id: int, qkv: Tensor, g: Tensor, beta: Tensor, mix, rows: Tensor, fresh: list[bool] | None,
            lengths: list[int] | None, fed: Tensor | None) -> Tensor:
        """One linear layer over the forward's rows -> o (B, T, Hv, Dv).

        Prefill (`fresh`, `lengths` given, host lists): each row on its own over its real tokens,
        from zero when fresh, else from its slot; the slot gets the final state. Decode (T = 1):
        all rows at once from their slots; `fed` (B,) bool says which rows' states are written back.
        """
        conv, state = self.conv[layer_id], self.state[layer_id]
        B, T, _ = qkv.shape
        if lengths is None:
            starts = torch.zeros(B, T, dtype=torch.bool, device=qkv.device)
            o, new_conv, new_state = mix(qkv, g, beta, starts, conv[rows], state[rows])
            keep = fed.view(B, *([1] * (conv.dim() - 1)))
            conv[rows] = torch.where(keep, new_conv.to(conv.dtype), conv[rows])
            state[rows] = torch.where(fed.view(B, 1, 1, 1), new_state, state[rows])
            return o
        outs = []
        for b in range(B):
            n, row = lengths[b], rows[b:b + 1]
            starts = torch.zeros(1, n, dtype=torch.bool, device=qkv.device)
            starts[0, 0] = fresh[b]
            init_conv, init_state = (None, None) if fresh[b] else (conv[row], state[row])
            o, new_conv, new_state = mix(qkv[b:b + 1, :n], g[b:b + 1, :n], beta[b:b + 1, :n], starts,
                                         init_conv, init_state)
            conv[row] = new_conv.to(conv.dtype)
            state[row] = new_state
            outs.append(torch.nn.functional.pad(o, (0, 0, 0, 0, 0, T - n)))
        return torch.cat(outs, dim=0)


class HybridPagedAttention(PagedAttention):
    """`PagedAttention` that also runs linear-attention layers over `RecurrentStates`.

    rows (B,) long: each forward row's state slot. Prefill: `fresh` and `lengths` (host lists,
    per row). Decode: neither; the rows fed this launch are those whose new token has a real KV
    slot (pads write to the null block).
    """

    def __init__(self, *args, states: RecurrentStates, rows: Tensor, fresh_rows: list[bool] | None = None,
                 lengths: list[int] | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.states = states
        self.rows = rows
        self.fresh_rows = fresh_rows
        self.lengths = lengths

    def attend_linear(self, layer_id: int, qkv: Tensor, g: Tensor, beta: Tensor, mix) -> Tensor:
        fed = None
        if self.lengths is None:
            fed = self.slots[:, 0] // self.cache.block_size != NULL_BLOCK
        return self.states.run(layer_id, qkv, g, beta, mix, self.rows, self.fresh_rows, self.lengths, fed)
