"""Attention over packed rows whose samples share one copy of their prompt (runtime/train/packing.py).

A shared-prompt row holds, besides plain documents, *units*: a prompt document (the shared prompt
minus its last token) followed by one branch document per sample (the last prompt token and that
sample's completion, positions continuing the prompt's). ``prompt_doc`` (1, T) is 0 outside branches
and 1 + the prompt document's id on a branch's tokens. Token i attends token j iff

    (doc[i] == doc[j] and j <= i)  or  doc[j] == prompt_doc[i] - 1

so a branch sees the whole prompt and itself causally, the prompt sees itself causally: each branch
token gets the keys, values and positions it has in its unshared document, hence the same outputs,
and the prompt's activations receive the sum of every branch's gradient, as the unshared copies'
would. Backends (the trainer's `trainer.attention`, resolved):

- "split": one causal SDPA per plain or prompt document, and per branch one SDPA of its queries over
  the prompt's and its own keys (concatenated) with a bottom-right causal mask. The CPU default.
- "sdpa": SDPA with the dense (1, 1, T, T) mask of the rule above; also what "split" uses for
  sliding windows (measured in positions, not row distance), attention sinks and sparse selection.
- "varlen" / "flash_attn": one flash varlen call; every document's keys are gathered as (its prompt
  document, if any) + itself, so cu_seqlens differ for queries and keys, and the kernels' causal mask
  is aligned bottom-right (flash-attn's documented convention; tests/gpu checks it against "sdpa").
- "flex": FlexAttention with a block mask built from the rule (create_block_mask).

Context parallelism and linear-attention layers (their recurrences restart at every document, and a
branch's would have to continue its prompt's) do not take these rows: the controller then packs
unshared rows (`unsupported`). The context does not expose `doc_ids`, so a linear-attention layer
handed one anyway refuses it (models/common/linear_attention.py) instead of restarting at branches.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from meshrl.models.common.attention import attention_with_sinks, document_cu_seqlens, selected
from meshrl.runtime.config import ModelConfig, TrainerConfig


def unsupported(model: ModelConfig, trainer: TrainerConfig) -> str | None:
    """Why this run cannot train shared-prompt rows (None: it can)."""
    if trainer.parallel.cp > 1:
        return f"context parallelism (trainer.parallel.cp = {trainer.parallel.cp}) splits rows over ranks"
    if model.path is not None:
        from pathlib import Path

        from meshrl.models.generic_hf import resolve_impl
        from meshrl.models.hf import read_hf_config

        config = read_hf_config(Path(model.path))
        model_type, impl = config.get("model_type"), resolve_impl(config.get("model_type"), model.impl, config)
    else:
        model_type, impl = model.family, "native"
    if impl == "native":
        from meshrl.models import get_family

        if get_family(model_type).parallel_plan.get("no_cp"):
            return f"model_type {model_type!r} has linear-attention layers (a branch cannot restart its recurrence)"
    return None


def enabled(model: ModelConfig, trainer: TrainerConfig) -> bool:
    """`trainer.share_prompts` where this run supports it; where not, one log line says why."""
    why = unsupported(model, trainer) if trainer.share_prompts else None
    if why:
        from meshrl.runtime.rundir import log

        log.info("trainer.share_prompts: off for this run, %s; every sample is packed with its own prompt", why)
    return trainer.share_prompts and why is None


def is_shared(mb: Any) -> bool:
    """True when a packed row (TensorDict) has a branch of a shared prompt."""
    return "prompt_doc" in mb.keys() and bool((mb["prompt_doc"] > 0).any())


def shared_prompt_mask(doc_ids: Tensor, prompt_doc: Tensor, positions: Tensor, window: int | None = None) -> Tensor:
    """(B, T, T) bool, the module docstring's rule; `window`: also pos[i] - pos[j] < window."""
    T = doc_ids.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=doc_ids.device).tril()
    same_doc = (doc_ids[:, :, None] == doc_ids[:, None, :]) & causal
    allowed = same_doc | (prompt_doc[:, :, None] - 1 == doc_ids[:, None, :])
    if window is not None:
        allowed &= positions[:, :, None] - positions[:, None, :] < window
    return allowed


def _lower_right(q_len: int, kv_len: int, device: torch.device) -> Tensor:
    """(q_len, kv_len) bool: query r attends keys <= kv_len - q_len + r (the queries are the last keys)."""
    return torch.ones(q_len, kv_len, dtype=torch.bool, device=device).tril(kv_len - q_len)


class SharedPromptAttention:
    """The attention context of a shared-prompt row (B == 1), for `backend` (module docstring).
    probe: on CUDA with a varlen backend, run `_varlen_aligns` now, outside compiled code (the probe
    itself builds one without)."""

    def __init__(self, doc_ids: Tensor, prompt_doc: Tensor, positions: Tensor, backend: str,
                 probe: bool = True) -> None:
        if doc_ids.dim() != 2 or doc_ids.shape[0] != 1:
            raise ValueError(f"shared-prompt rows are single packed rows, doc_ids (1, T); got {tuple(doc_ids.shape)}")
        if backend not in ("split", "sdpa", "varlen", "flash_attn", "flex"):
            raise ValueError(f"attention backend {backend!r} has no shared-prompt path")
        # not `doc_ids`: linear-attention layers read that to restart their recurrences per document
        self.row_doc_ids, self.prompt_doc, self.positions, self.backend = doc_ids, prompt_doc, positions, backend
        cu, _ = document_cu_seqlens(doc_ids)
        cu = cu.tolist()
        self.bounds = list(zip(cu[:-1], cu[1:]))  # [(start, end)] per document
        firsts = prompt_doc[0, cu[:-1]].tolist()
        self.prompt_index = [None if p == 0 else p - 1 for p in firsts]  # each document's prompt document
        self.prompt_of = [None if p is None else self.bounds[p] for p in self.prompt_index]
        for d, p in enumerate(firsts):
            assert p == 0 or (p - 1 < d and firsts[p - 1] == 0), f"document {d}: bad prompt document {p - 1}"
        self._masks: dict[int | None, Tensor] = {}
        self._branch_masks: dict[tuple[int, int], Tensor] = {}  # (queries, keys) -> bottom-right causal mask
        self._gather: tuple | None = None
        self._block_mask: Any = None
        if probe and backend in ("varlen", "flash_attn") and doc_ids.is_cuda:
            for dtype in (torch.bfloat16, torch.float16):  # probed here, outside compiled code (see _ALIGNS)
                _varlen_aligns(backend, doc_ids.device, dtype)

    def mask(self, device: torch.device, window: int | None = None) -> Tensor:
        """(1, 1, T, T) bool of the rule, cached per window."""
        if window not in self._masks:
            self._masks[window] = shared_prompt_mask(self.row_doc_ids.to(device), self.prompt_doc.to(device),
                                                     self.positions.to(device), window)[:, None]
        return self._masks[window]

    def attend(self, layer_id: int, q: Tensor, k: Tensor, v: Tensor, window: int | None = None,
               sinks: Tensor | None = None, index: tuple | None = None, keep: Tensor | None = None) -> Tensor:
        B, num_q_heads, T, _ = q.shape
        assert self.row_doc_ids.shape == (B, T), f"doc_ids {tuple(self.row_doc_ids.shape)} vs q {tuple(q.shape)}"
        special = window is not None or sinks is not None or index is not None or keep is not None
        if special and self.backend not in ("split", "sdpa"):
            raise ValueError(f"the {self.backend!r} attention backend has no sliding windows, attention sinks or "
                             "sparse selection on shared-prompt rows; use trainer.attention = 'sdpa' or 'split'")
        if self.backend == "sdpa" or special:
            return self._dense(q, k, v, window, sinks, index, keep)
        if self.backend == "split":
            return self._split(q, k, v)
        if self.backend == "flex":
            return self._flex(q, k, v)
        if not _varlen_aligns(self.backend, q.device, q.dtype):  # probed at __init__: a dict read here
            return self._split(q, k, v)
        return self._varlen(q, k, v)

    def _dense(self, q: Tensor, k: Tensor, v: Tensor, window: int | None, sinks: Tensor | None,
               index: tuple | None, keep: Tensor | None) -> Tensor:
        mask = self.mask(q.device, window)
        if index is not None or keep is not None:
            mask = selected(mask[:, 0], None if index is None else index[0], index, keep)
        if sinks is not None:
            return attention_with_sinks(q, k, v, mask, sinks)
        n_rep = q.shape[1] // k.shape[1]
        if n_rep > 1:  # as DocumentCausalAttention: the masked CUDA kernel takes no enable_gqa
            k, v = k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    def _split(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        gqa = q.shape[1] != k.shape[1]
        sizes = [e - s for s, e in self.bounds]
        # torch.split: one concatenation in backward (see SplitDocumentAttention)
        qs, ks, vs = q.split(sizes, dim=2), k.split(sizes, dim=2), v.split(sizes, dim=2)
        outs = []
        for d, p in enumerate(self.prompt_index):
            if p is None:
                outs.append(F.scaled_dot_product_attention(qs[d], ks[d], vs[d], is_causal=True, enable_gqa=gqa))
                continue
            kd, vd = torch.cat([ks[p], ks[d]], dim=2), torch.cat([vs[p], vs[d]], dim=2)
            shape = (sizes[d], kd.shape[2])
            if shape not in self._branch_masks:  # built once per forward, reused by every layer
                self._branch_masks[shape] = _lower_right(*shape, q.device)
            mask = self._branch_masks[shape]
            outs.append(F.scaled_dot_product_attention(qs[d], kd, vd, attn_mask=mask, enable_gqa=gqa))
        return torch.cat(outs, dim=2)

    def gather_index(self, device: torch.device) -> tuple[Tensor, Tensor, Tensor, int, int]:
        """(key index (T',) into the row, cu_seqlens_q, cu_seqlens_k (num_docs + 1,) int32, max q, max k)."""
        if self._gather is None:
            index, cu_k = [], [0]
            for (s, e), prompt in zip(self.bounds, self.prompt_of):
                if prompt is not None:
                    index.extend(range(*prompt))
                index.extend(range(s, e))
                cu_k.append(len(index))
            cu_q = [s for s, _ in self.bounds] + [self.bounds[-1][1]]
            max_q = max(e - s for s, e in self.bounds)
            max_k = max(b - a for a, b in zip(cu_k[:-1], cu_k[1:]))
            as_int = functools.partial(torch.tensor, dtype=torch.int32, device=device)
            self._gather = (torch.tensor(index, device=device), as_int(cu_q), as_int(cu_k), max_q, max_k)
        return self._gather

    def _varlen(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        if q.dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"varlen (flash) attention needs bf16 or fp16 q/k/v, got {q.dtype}")
        index, cu_q, cu_k, max_q, max_k = self.gather_index(q.device)
        q_, k_, v_ = (x[0].transpose(0, 1) for x in (q, k, v))  # (T, H, D)
        q_, k_, v_ = q_.contiguous(), k_.index_select(0, index), v_.index_select(0, index)
        from meshrl.models.common import attention

        varlen = attention._flash_attn_varlen_causal if self.backend == "flash_attn" else attention._torch_varlen_causal
        return varlen(q_, k_, v_, cu_q, max_q, cu_k, max_k).transpose(0, 1).unsqueeze(0)

    def _flex(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        from torch.nn.attention.flex_attention import create_block_mask

        from meshrl.models.common.attention import flex_length, pad_doc_ids, run_flex

        if self._block_mask is None:
            # Padded to the compiled kernel's bucket: the padding is one more document, with no prompt.
            L = flex_length(q.shape[2])
            doc = pad_doc_ids(self.row_doc_ids.to(q.device), L)[0]
            pd = torch.nn.functional.pad(self.prompt_doc[0].to(q.device), (0, L - q.shape[2]))

            def rule(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
                return ((kv_idx <= q_idx) & (doc[q_idx] == doc[kv_idx])) | (pd[q_idx] - 1 == doc[kv_idx])

            self._block_mask = create_block_mask(rule, 1, None, L, L, device=q.device)
        return run_flex(q, k, v, self._block_mask)


# (backend, device, dtype) -> the probe's answer. A dict `_varlen_aligns` reads first, not
# functools.cache: dynamo traces through a cache wrapper into the probe (host syncs) and would break
# each compiled block's graph at its attention; `SharedPromptAttention` probes when it is built,
# outside compiled code, so compiled code only takes the early return.
_ALIGNS: dict[tuple[str, torch.device, torch.dtype], bool] = {}


def _varlen_aligns(backend: str, device: torch.device, dtype: torch.dtype) -> bool:
    """Once per process and kernel: does the varlen path on this device give the dense rule on a small
    shared row (i.e. does the kernel align its causal mask bottom-right when queries are fewer than
    keys)? If not, shared rows use "split" there, said once in the log."""
    if (backend, device, dtype) in _ALIGNS:
        return _ALIGNS[(backend, device, dtype)]
    from meshrl.runtime.rundir import log

    doc = torch.tensor([[0] * 5 + [1] * 3 + [2] * 4 + [3] * 2], device=device)
    prompt_doc = torch.tensor([[0] * 5 + [1] * 7 + [0] * 2], device=device)
    positions = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7, 5, 6, 7, 8, 0, 1]], device=device)
    gen = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(1, 4, 14, 64, generator=gen, device=device)
    k, v = (torch.randn(1, 2, 14, 64, generator=gen, device=device) for _ in range(2))
    got = SharedPromptAttention(doc, prompt_doc, positions, backend, probe=False)._varlen(q.to(dtype), k.to(dtype),
                                                                                           v.to(dtype))
    want = SharedPromptAttention(doc, prompt_doc, positions, "sdpa")._dense(q, k, v, None, None, None, None)
    ok = bool(((got.float() - want).norm() / want.norm()) < 2e-2)
    if not ok:
        log.warning("shared-prompt rows: the %s kernel on %s does not give the shared-prompt attention (causal mask "
                    "not aligned bottom-right?); using per-document SDPA ('split') for them", backend, device)
    _ALIGNS[(backend, device, dtype)] = ok
    return ok
