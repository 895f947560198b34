"""The trainer: one optimizer step over packed micro-batches, for RL and SFT.

Every trainer rank holds an FSDP2 shard of the policy and receives its own list of packed
micro-batches for the step (the controller gives every rank the same number). The loss of
each micro-batch is a sum over its loss tokens divided by the step's global loss-token
count, multiplied by the data-parallel size to cancel FSDP's gradient averaging (see
runtime/algorithms.py), so the update is the per-token mean over the global batch whatever
the split. Statistics are sums, all-reduced once per step over the trainer group.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from tensordict import TensorDict
from torch import nn
from torch.distributed.tensor import DTensor

from meshrl.models.common.attention import DocumentCausalAttention
from meshrl.runtime import algorithms
from meshrl.runtime.config import LossConfig, OptimConfig

_STAT_KEYS = ("loss_tokens", "masked_tokens", "mismatch_kl_sum", "entropy_sum", "pg_loss_sum",
              "kl_loss_sum", "nll_sum", "tokens")


class Trainer:
    """Optimizer, schedule and the step functions around an (already parallelized) model."""

    def __init__(self, model: nn.Module, cfg: OptimConfig, device: torch.device,
                 group: dist.ProcessGroup | None, dp_size: int):
        self.model = model
        self.cfg = cfg
        self.device = device
        self.group = group
        self.dp_size = dp_size
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
                                           weight_decay=cfg.weight_decay)
        warmup = cfg.warmup_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: min(1.0, (step + 1) / warmup) if warmup else 1.0)
        self.version = 0
        """Optimizer steps taken = the policy version the weights now carry."""

    def _forward(self, mb: TensorDict, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-probabilities (1, T) of the targets and entropies (1, T) of one packed row."""
        mb = mb.to(self.device)
        attn = DocumentCausalAttention(mb["doc_ids"])
        logits = self.model(mb["input_ids"], mb["position_ids"], attn)  # (1, T, V)
        return algorithms.token_logprobs(logits, mb["targets"], temperature)

    def rl_step(self, micro_batches: list[TensorDict], num_loss_tokens: int, loss: LossConfig,
                temperature: float) -> dict[str, float]:
        """One RL optimizer step; returns global statistics (identical on every trainer rank)."""
        start = time.perf_counter()
        self.model.train()
        sums = torch.zeros(len(_STAT_KEYS), dtype=torch.float64, device=self.device)
        for mb in micro_batches:
            logprobs, entropy = self._forward(mb, temperature)
            mask = mb["loss_mask"].to(self.device)
            value, stats = algorithms.policy_loss(
                logprobs, mb["inference_logprobs"].to(self.device), mb["advantages"].to(self.device), mask,
                delta_low=loss.delta_low, delta_high=loss.delta_high, kl_coef=loss.kl_coef,
                num_loss_tokens=max(num_loss_tokens, 1))
            (value * self.dp_size).backward()
            stats["entropy_sum"] = torch.where(mask, entropy, 0.0).sum()
            stats["tokens"] = torch.tensor(float(mb["input_ids"].numel()))
            sums += torch.stack([stats.get(k, torch.tensor(0.0)).to(sums) for k in _STAT_KEYS])
        grad_norm = self._optimizer_step(skip=num_loss_tokens == 0)
        out = self._reduce(sums)
        n = max(out["loss_tokens"], 1.0)
        return {
            "loss": (out["pg_loss_sum"] + out["kl_loss_sum"]) / n,
            "pg_loss": out["pg_loss_sum"] / n,
            "kl_loss": out["kl_loss_sum"] / n,
            "mismatch_kl": out["mismatch_kl_sum"] / n,
            "entropy": out["entropy_sum"] / n,
            "masked_fraction": out["masked_tokens"] / n,
            "grad_norm": grad_norm,
            "lr": self.scheduler.get_last_lr()[0],
            "loss_tokens": out["loss_tokens"],
            "train_tokens": out["tokens"],
            "train_time_s": time.perf_counter() - start,
        }

    def sft_step(self, micro_batches: list[TensorDict], num_loss_tokens: int) -> dict[str, float]:
        """One supervised step (negative log-likelihood of the completion tokens)."""
        start = time.perf_counter()
        self.model.train()
        sums = torch.zeros(len(_STAT_KEYS), dtype=torch.float64, device=self.device)
        for mb in micro_batches:
            logprobs, _ = self._forward(mb, temperature=1.0)
            mask = mb["loss_mask"].to(self.device)
            value = algorithms.sft_loss(logprobs, mask, max(num_loss_tokens, 1))
            (value * self.dp_size).backward()
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
        }

    def _optimizer_step(self, skip: bool) -> float:
        """Clip, step, advance the schedule and the version. Returns the global grad norm."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, self.cfg.max_grad_norm) if params else torch.tensor(0.0)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        if not skip:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.version += 1
        return float(norm)

    def _reduce(self, sums: torch.Tensor) -> dict[str, float]:
        if self.group is not None and dist.get_world_size(self.group) > 1:
            dist.all_reduce(sums, group=self.group)
        return dict(zip(_STAT_KEYS, sums.tolist()))
