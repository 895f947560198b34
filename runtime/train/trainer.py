"""The trainer: one optimizer step over packed micro-batches, for RL and SFT.

Every trainer rank holds an FSDP2 shard of the policy and receives the packed micro-batches
of its *data rank* for the step (the controller gives every data rank the same number; the
cp ranks of one data rank receive the same rows and each keeps its piece, see
parallel/context_parallel.py). The loss of each micro-batch is a sum over its loss tokens
divided by the step's global loss-token count, and FSDP2 sums (does not average) gradients
over the data-parallel ranks (parallel/parallelize.py), so the update is the per-token mean
over the global batch whatever the split. Statistics are sums, all-reduced once per step
over the trainer group.

The RL loss of each micro-batch is `policy_loss`: the `trainer.loss.type` entry of
losses.POLICY_LOSSES, its policy-gradient terms weighted by the `trainer.loss.correction` factors
(losses.correction_weights; docs/algorithms.md).

A row that shares prompts (runtime/train/packing.py, `trainer.share_prompts`) gets a
`SharedPromptAttention` context (runtime/train/shared_prompt.py) for the resolved backend; the loss
sees the same loss tokens as unshared packing.

Logprobs come from a chunked LM head (runtime/train/logprob_head.py) that runs inside the model's
forward: full (T, V) fp32 logits never exist, whatever the vocabulary.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from tensordict import TensorDict
from torch import nn
from torch.distributed.tensor import DTensor

from meshrl.models.common.attention import CausalAttention, make_document_attention
from meshrl.models.common.moe import moe_aux_loss, pop_moe_stats, record_moe_stats
from meshrl.parallel.dims import TrainerMeshes
from meshrl.parallel.parallelize import clip_grad_norm_, reshard
from meshrl.runtime.train import losses
from meshrl.runtime.config import LossConfig, OptimConfig
from meshrl.runtime.train.logprob_head import LogprobHead
from meshrl.runtime.train.shared_prompt import SharedPromptAttention, is_shared
from meshrl.runtime.rundir import log

_STAT_KEYS = ("loss_tokens", "masked_tokens", "clipped_tokens", "corrected_tokens", "mismatch_kl_sum", "entropy_sum",
              "pg_loss_sum", "kl_loss_sum", "nll_sum", "tokens", "aux_loss_sum")


@dataclass
class _Accumulation:
    """An RL step between its first `accumulate_rl` and `finish_rl_step`."""

    scale: int                 # what every micro-batch loss of the step divided by
    sums: torch.Tensor         # (len(_STAT_KEYS),) float64 statistic sums of this rank
    busy_s: float = 0.0        # seconds spent in the step's parts
    last_s: float = 0.0        # of them, in the latest part
    parts: int = 0             # accumulate_rl calls


def resolve_attention(backend: str, device: torch.device, compute_dtype: torch.dtype) -> str:
    """"auto": torch's varlen flash kernel on GPU in bf16/fp16 (packed rows, no compile); on CPU one
    causal SDPA per document ("split": the cost of the documents, not of a (T, T) mask over the
    row); else SDPA with a document mask (GPU in fp32: compiled FlexAttention found no kernel for a
    small fp32 model on torch 2.11 and failed inside the RL trainer, so "flex" is opt-in)."""
    if backend != "auto":
        return backend
    if device.type != "cuda":
        return "split"
    from meshrl.models.common.attention import _torch_varlen_attn

    half = compute_dtype in (torch.bfloat16, torch.float16)
    return "varlen" if half and _torch_varlen_attn() is not None else "sdpa"


def policy_loss(mb: TensorDict, logprobs: torch.Tensor, loss: LossConfig,
                num_loss_tokens: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``loss.type``'s policy loss of one micro-batch, with ``loss.correction`` applied (losses.py)."""
    mask = mb["loss_mask"]
    weights, corrected = None, torch.zeros_like(mask)
    if loss.correction != "none":
        low, high = loss.correction_bounds
        weights, corrected = losses.correction_weights(
            logprobs, mb["inference_logprobs"], mask, mb["sample_ids"], kind=loss.correction,
            level=loss.correction_level, low=low, high=high)
    value, stats = losses.POLICY_LOSSES[loss.type](
        logprobs, mb["inference_logprobs"], mb["advantages"], mask, kl_coef=loss.kl_coef,
        num_loss_tokens=num_loss_tokens, weights=weights, sample_ids=mb["sample_ids"], **loss.params)
    stats["corrected_tokens"] = corrected.sum().float()
    return value, stats


class Trainer:
    """Optimizer, schedule and the step functions around an (already parallelized) model.

    `meshes` carries the cp group (None: no context parallelism); `attention` names the
    packed-row attention kernel (see `resolve_attention` for "auto").
    """

    def __init__(self, model: nn.Module, cfg: OptimConfig, device: torch.device,
                 group: dist.ProcessGroup | None, meshes: TrainerMeshes | None = None, attention: str = "auto",
                 logprob_chunk_tokens: int = 4096, moe_aux_loss_coef: float = 0.0,
                 compute_dtype: torch.dtype = torch.float32):
        self.model = model
        self.cfg = cfg
        self.device = device
        self.group = group
        self.meshes = meshes
        self.attention = resolve_attention(attention, device, compute_dtype)
        self.logprob_chunk_tokens = logprob_chunk_tokens
        self.moe_aux_loss_coef = moe_aux_loss_coef
        # only what trains: with LoRA the adapters (the base weights are frozen, models/common/lora.py)
        trainable = [p for p in model.parameters() if p.requires_grad]
        # On CUDA one fused kernel per step (the foreach default launches a chain of them over every
        # parameter; torchtitan's default too) where every parameter is on one mesh (expert shards
        # on their own mesh keep the default); CPU keeps the default (its tests compare against it).
        # MESHRL_FUSED_ADAMW=0 keeps the default on CUDA (to compare).
        meshes_of_params = {id(p.device_mesh) for p in trainable if isinstance(p, DTensor)}
        fused = device.type == "cuda" and len(meshes_of_params) <= 1 and os.environ.get("MESHRL_FUSED_ADAMW") != "0"
        self.optimizer = torch.optim.AdamW(trainable, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
                                           weight_decay=cfg.weight_decay, fused=True if fused else None)
        warmup = cfg.warmup_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: min(1.0, (step + 1) / warmup) if warmup else 1.0)
        self.version = 0
        """Optimizer steps taken = the policy version the weights now carry."""
        self.nonfinite_steps = 0
        """Steps whose gradient norm was NaN/inf and whose update was therefore skipped."""
        self._acc: _Accumulation | None = None
        """The RL step being accumulated (`accumulate_rl`) until `finish_rl_step`."""

    def state_dict(self) -> dict[str, int]:
        """The counters saved beside the sharded weights and AdamW state (runtime/checkpoint.py)."""
        return {"version": self.version, "nonfinite_steps": self.nonfinite_steps}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Restore the counters and the schedule's position. The schedule is a function of the step
        and its base lr comes from the current config, so a changed lr applies from the resume on."""
        self.version = state["version"]
        self.nonfinite_steps = state.get("nonfinite_steps", 0)
        sched = self.scheduler
        sched.last_epoch = self.version
        for group, base, fn in zip(self.optimizer.param_groups, sched.base_lrs, sched.lr_lambdas):
            group["lr"] = base * fn(self.version)
        sched._last_lr = [group["lr"] for group in self.optimizer.param_groups]

    @property
    def cp(self) -> int:
        return 1 if self.meshes is None else self.meshes.dims.cp

    def _forward(self, mb: TensorDict, temperature: float) -> tuple[TensorDict, torch.Tensor, torch.Tensor]:
        """This rank's piece of one packed row, with its target logprobs (1, T') and entropies (1, T')."""
        # A row that is one document needs no document mask: plain causal SDPA then picks the
        # fastest fused kernel (cuDNN / flash), which beats the varlen and flex kernels.
        single_document = self.cp == 1 and int(mb["doc_ids"].max()) == 0
        shared = is_shared(mb)
        host_doc_ids = mb["doc_ids"] if mb["doc_ids"].device.type == "cpu" else None
        mb = mb.to(self.device)
        if single_document:
            attn = CausalAttention()
        elif shared:
            if self.cp > 1:
                raise ValueError("shared-prompt rows cannot be split over context-parallel ranks "
                                 "(the controller packs unshared rows when trainer.parallel.cp > 1)")
            attn = SharedPromptAttention(mb["doc_ids"], mb["prompt_doc"], mb["position_ids"], self.attention)
        elif self.cp > 1:
            from meshrl.parallel.context_parallel import ContextParallelAttention, cp_split, pad_for_cp

            full = pad_for_cp(mb, self.cp)
            mb, local_index = cp_split(full, self.meshes.cp_rank, self.cp)
            attn = ContextParallelAttention(full["doc_ids"], local_index, self.meshes.cp_group)
        else:
            attn = make_document_attention(mb["doc_ids"], self.attention, host_doc_ids)
        head = LogprobHead(mb["targets"], temperature, self.logprob_chunk_tokens)
        logprobs, entropy = self.model(mb["input_ids"], mb["position_ids"], attn, head=head)
        record_moe_stats(self.model)  # before backward, which may recompute (checkpointed) blocks
        return mb, logprobs, entropy

    def rl_step(self, micro_batches: list[TensorDict], num_loss_tokens: int, loss: LossConfig,
                temperature: float) -> dict[str, float]:
        """One RL optimizer step; returns global statistics (identical on every trainer rank)."""
        self.accumulate_rl(micro_batches, max(num_loss_tokens, 1), loss, temperature)
        return self.finish_rl_step(num_loss_tokens)

    def accumulate_rl(self, micro_batches: list[TensorDict], scale: int, loss: LossConfig,
                      temperature: float) -> None:
        """Forward and backward over some of a step's micro-batches, gradients accumulating; no update.

        Each micro-batch's loss divides by `scale` instead of the step's loss-token count, which a step
        trained in parts (`trainer.overlap_rollout`: groups trained while the rest still generate) only
        knows at its end. Every part of a step and every rank must use the same `scale`: FSDP sums the
        ranks' gradients as they are. The losses are linear in 1 / normaliser, so `finish_rl_step`
        rescales the summed gradients by scale / num_loss_tokens once, before clipping; the update
        equals the one-part step's up to float reassociation.
        """
        start = time.perf_counter()
        acc = self._acc
        if acc is None:
            self.model.train()
            acc = self._acc = _Accumulation(scale, torch.zeros(len(_STAT_KEYS), dtype=torch.float64,
                                                               device=self.device))
        assert acc.scale == scale, f"a step's parts must share one loss scale ({acc.scale} != {scale})"
        for mb in micro_batches:
            mb, logprobs, entropy = self._forward(mb, temperature)
            mask = mb["loss_mask"]
            value, stats = policy_loss(mb, logprobs, loss, scale)
            value = self._with_aux(value, mask, scale, stats)
            value.backward()
            stats["entropy_sum"] = torch.where(mask, entropy, 0.0).sum()
            stats["tokens"] = torch.tensor(float(mb["input_ids"].numel()))
            acc.sums += torch.stack([stats.get(k, torch.tensor(0.0)).to(acc.sums) for k in _STAT_KEYS])
        acc.parts += 1
        acc.last_s = time.perf_counter() - start
        acc.busy_s += acc.last_s

    def finish_rl_step(self, num_loss_tokens: int) -> dict[str, float]:
        """The optimizer step after `accumulate_rl`: gradients rescaled to the step's global loss-token
        count, clipped, applied; returns the step's global statistics (identical on every rank).
        `train_time_s` counts this rank's seconds in the step's parts and here, not the waits between;
        `train_tail_s` those of the last part and the update (what the step waits for once its last
        rollout is in)."""
        start = time.perf_counter()
        acc, self._acc = self._acc, None
        if acc is None:  # no micro-batch on any rank (every group filtered): nothing was accumulated
            acc = _Accumulation(max(num_loss_tokens, 1), torch.zeros(len(_STAT_KEYS), dtype=torch.float64,
                                                                     device=self.device))
        if num_loss_tokens > 0 and acc.scale != num_loss_tokens:
            factor = acc.scale / num_loss_tokens
            grads = [p.grad for p in self.model.parameters() if p.grad is not None]
            if grads:
                torch._foreach_mul_(grads, factor)
            acc.sums[_STAT_KEYS.index("aux_loss_sum")] *= factor  # the aux loss is weighted by 1 / scale too
        grad_norm = self._optimizer_step(skip=num_loss_tokens == 0)
        out = self._reduce(acc.sums)
        n = max(out["loss_tokens"], 1.0)
        tail_s = time.perf_counter() - start
        return {
            "loss": (out["pg_loss_sum"] + out["kl_loss_sum"]) / n,
            "pg_loss": out["pg_loss_sum"] / n,
            "kl_loss": out["kl_loss_sum"] / n,
            "mismatch_kl": out["mismatch_kl_sum"] / n,
            "entropy": out["entropy_sum"] / n,
            "masked_fraction": out["masked_tokens"] / n,
            "loss/clipped_fraction": out["clipped_tokens"] / n,
            "loss/correction_fraction": out["corrected_tokens"] / n,
            "grad_norm": grad_norm,
            "lr": self.scheduler.get_last_lr()[0],
            "loss_tokens": out["loss_tokens"],
            "train_tokens": out["tokens"],
            "train_time_s": acc.busy_s + tail_s,
            "train_tail_s": acc.last_s + tail_s,
            "nonfinite_steps": self.nonfinite_steps,
            **self._moe_stats(out),
        }

    def sft_step(self, micro_batches: list[TensorDict], num_loss_tokens: int) -> dict[str, float]:
        """One supervised step (negative log-likelihood of the completion tokens)."""
        start = time.perf_counter()
        self.model.train()
        sums = torch.zeros(len(_STAT_KEYS), dtype=torch.float64, device=self.device)
        for mb in micro_batches:
            mb, logprobs, _ = self._forward(mb, temperature=1.0)
            mask = mb["loss_mask"]
            value = losses.sft_loss(logprobs, mask, max(num_loss_tokens, 1))
            aux_stats: dict[str, torch.Tensor] = {}
            value = self._with_aux(value, mask, num_loss_tokens, aux_stats)
            value.backward()
            if "aux_loss_sum" in aux_stats:
                sums[_STAT_KEYS.index("aux_loss_sum")] += aux_stats["aux_loss_sum"].to(sums)
            sums[_STAT_KEYS.index("nll_sum")] += -torch.where(mask, logprobs.detach(), 0.0).sum().double()
            sums[_STAT_KEYS.index("loss_tokens")] += mask.sum()
            sums[_STAT_KEYS.index("tokens")] += mb["input_ids"].numel()
        grad_norm = self._optimizer_step(skip=num_loss_tokens == 0)
        out = self._reduce(sums)
        return {
            "loss": out["nll_sum"] / max(out["loss_tokens"], 1.0),
            "grad_norm": grad_norm,
            "lr": self.scheduler.get_last_lr()[0],
            "train_tokens": out["tokens"],
            "train_time_s": time.perf_counter() - start,
            "nonfinite_steps": self.nonfinite_steps,
            **self._moe_stats(out),
        }

    @torch.no_grad()
    def eval_loss(self, micro_batches: list[TensorDict]) -> float:
        """Mean negative log-likelihood over the loss tokens of every rank's micro-batches (no update;
        collective over the trainer group, like a step)."""
        self.model.eval()
        sums = torch.zeros(2, dtype=torch.float64, device=self.device)
        for mb in micro_batches:
            mb, logprobs, _ = self._forward(mb, temperature=1.0)
            mask = mb["loss_mask"]
            sums[0] += -torch.where(mask, logprobs, 0.0).sum().double()
            sums[1] += mask.sum()
        pop_moe_stats(self.model)  # an evaluation's routing is not the step's
        reshard(self.model)
        if self.group is not None and dist.get_world_size(self.group) > 1:
            dist.all_reduce(sums, group=self.group)
        return float(sums[0] / sums[1].clamp(min=1))

    def _with_aux(self, value: torch.Tensor, mask: torch.Tensor, num_loss_tokens: int,
                  stats: dict[str, torch.Tensor]) -> torch.Tensor:
        """Add the MoE aux loss of the last forward to `value` (when configured); record it in `stats`.

        The aux loss is weighted by this row's share of the step's loss tokens, so the step's
        total is a token-weighted mean over rows and ranks.
        """
        aux = moe_aux_loss(self.model)
        if aux is None:
            return value
        aux = aux * (mask.sum() / max(num_loss_tokens, 1))
        stats["aux_loss_sum"] = aux.detach().float()
        return value + self.moe_aux_loss_coef * aux if self.moe_aux_loss_coef > 0 else value

    def _moe_stats(self, out: dict[str, float]) -> dict[str, float]:
        """Load-balance statistics of the step's forwards (empty for dense models), averaged over ranks."""
        local = pop_moe_stats(self.model)
        if not local:
            return {}
        keys = sorted(local)
        values = torch.tensor([local[k] for k in keys], dtype=torch.float64, device=self.device)
        if self.group is not None and dist.get_world_size(self.group) > 1:
            dist.all_reduce(values, group=self.group)
            values /= dist.get_world_size(self.group)
        stats = dict(zip(keys, values.tolist()))
        stats["moe/aux_loss"] = out["aux_loss_sum"]  # token-weighted over the step's rows
        return stats

    def _optimizer_step(self, skip: bool) -> float:
        """Clip, step, advance the schedule and the version. Returns the global grad norm. A skipped
        step (no loss tokens, or a non-finite norm) leaves the weights and the learning-rate schedule
        where they were (the warm-up counts optimizer steps); the version still advances."""
        shard_group = None if self.meshes is None else self.meshes.shard_group
        norm = clip_grad_norm_(self.model, self.cfg.max_grad_norm, shard_group)
        if not math.isfinite(norm):  # the same global norm on every rank: all skip together
            self.nonfinite_steps += 1
            log.warning("optimizer step %d: gradient norm %s; update skipped, weights unchanged (%d such steps so far)",
                        self.version, norm, self.nonfinite_steps)
            skip = True
        if not skip:
            self.optimizer.step()
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.version += 1
        return norm

    def _reduce(self, sums: torch.Tensor) -> dict[str, float]:
        if self.group is not None and dist.get_world_size(self.group) > 1:
            dist.all_reduce(sums, group=self.group)
        return dict(zip(_STAT_KEYS, sums.tolist()))
