"""Mixture-of-experts feed-forward with top-k routing, shared by the MoE families.

    router:   logits = x @ router.T               (N, E) in the activation dtype
              probs  = softmax(logits.float())    fp32, over all E experts
              top_w, top_i = topk(probs, k)       optionally renormalised to sum 1 (norm_topk_prob)
    experts:  y_t = sum_j top_w[t, j] * SwiGLU_{top_i[t, j]}(x_t)
    shared:   + sigmoid(x @ g) * SwiGLU_shared(x) (Qwen2-MoE; off for Qwen3-MoE)

The experts' weights are stored grouped, one tensor per projection with the expert on dim 0
(`w1`/`w3`: (E, hidden, dim), `w2`: (E, dim, hidden), i.e. HF's per-expert
gate_proj/up_proj/down_proj matrices stacked), so expert parallelism can split them on dim 0
and a grouped GEMM can run all experts in one kernel.

Token dispatch: every (token, slot) pair is sorted by expert, the rows are gathered in that
order, each expert runs on its contiguous group of rows, and the outputs are weighted and
summed back into their tokens with one `index_add`. Running the experts on the sorted rows is
the dispatcher's job: `MoE.dispatcher(experts, x_sorted, counts)` runs them locally by
default, and parallel/expert_parallel.py swaps in one that ships rows to the rank holding
their expert by all-to-all. Routing, weighting and the combine stay local either way, so the
router's gradient never crosses ranks.

Load-balancing statistics: each forward leaves on its MoE module a differentiable Switch-style
auxiliary loss `E * sum_e f_e * P_e` (f_e = share of top-k assignments to expert e, summing to
k over experts; P_e = mean router probability of e), which is what transformers'
`load_balancing_loss_func` returns for a single layer, plus detached per-expert assignment
counts. `moe_aux_loss(model)` sums the aux losses of the last forward (transformers instead
pools the counts and probabilities of all layers before multiplying; the two agree for one
MoE layer). `record_moe_stats(model)` (after every forward) accumulates the counts and
`pop_moe_stats(model)` reports and resets them. Every token of the batch counts, padding
included: the model never sees a padding mask. Statistics are per rank (the trainer averages
them over ranks); a block recomputed under activation checkpointing records nothing.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from meshrl.models.common.ffn import FeedForward


def _grouped_mm_ok(x: Tensor, w: Tensor) -> bool:
    """Whether torch._grouped_mm can run these experts: Hopper or newer, bf16, 16-byte aligned rows."""
    return (hasattr(torch, "_grouped_mm") and x.is_cuda and x.dtype == torch.bfloat16 and w.dtype == torch.bfloat16
            and torch.cuda.get_device_capability(x.device) >= (9, 0)
            and x.shape[-1] % 8 == 0 and w.shape[1] % 8 == 0)


class GroupedExperts(nn.Module):
    """`num_experts` SwiGLU experts with grouped weights; expert e is w2[e](silu(w1[e] x) * w3[e] x).

    The module runs experts on rows already grouped by expert. After expert parallelism it
    holds only its rank's experts (`num_experts` = E / ep); the rest of the model is unaware.
    """

    def __init__(self, dim: int, hidden_dim: int, num_experts: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        # Benchmarks may turn the grouped GEMM off to time the per-expert loop.
        self.use_grouped_mm = True

    def forward(self, x: Tensor, counts: Tensor) -> Tensor:
        # x: (M, dim) rows grouped by expert, ascending; counts: (num_experts,) int64 summing to M -> (M, dim)
        assert counts.shape == (self.num_experts,), f"counts {tuple(counts.shape)} vs {self.num_experts} experts"
        w1, w2, w3 = self.w1, self.w2, self.w3
        if self.use_grouped_mm and _grouped_mm_ok(x, w1):
            # One kernel per projection over all groups; offsets are cumulative row ends (no host sync).
            offs = counts.cumsum(0).to(torch.int32)
            h = F.silu(torch._grouped_mm(x, w1.transpose(-2, -1), offs=offs))
            h = h * torch._grouped_mm(x, w3.transpose(-2, -1), offs=offs)
            return torch._grouped_mm(h, w2.transpose(-2, -1), offs=offs)
        # Every expert runs, also on zero rows: its weights then get a zero gradient instead of
        # none, so all ranks reduce the same gradients under FSDP whatever the routing.
        outs = []
        for e, xe in enumerate(torch.split(x, counts.tolist())):
            outs.append(F.linear(F.silu(F.linear(xe, w1[e])) * F.linear(xe, w3[e]), w2[e]))
        return torch.cat(outs) if outs else x.new_zeros(0, x.shape[-1])

    @torch.no_grad()
    def init_weights(self, std: float, out_std: float, generator: torch.Generator | None = None) -> None:
        """w1, w3 ~ N(0, std); w2 (the residual output projection) ~ N(0, out_std)."""
        nn.init.normal_(self.w1, mean=0.0, std=std, generator=generator)
        nn.init.normal_(self.w2, mean=0.0, std=out_std, generator=generator)
        nn.init.normal_(self.w3, mean=0.0, std=std, generator=generator)

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, dim={self.w1.shape[2]}, hidden_dim={self.w1.shape[1]}"


# A dispatcher runs rows grouped by (global) expert through the experts:
# (experts, x_sorted (M, dim), counts (E,) int64) -> (M, dim).
Dispatcher = Callable[[GroupedExperts, Tensor, Tensor], Tensor]


def local_dispatch(experts: GroupedExperts, x: Tensor, counts: Tensor) -> Tensor:
    """All experts are on this rank: run them in place."""
    return experts(x, counts)


class MoE(nn.Module):
    """Top-k routed SwiGLU experts, with an optional sigmoid-gated shared expert.

    Parameters: `router.weight` (E, dim), `experts.w1/w2/w3`, and with a shared expert
    `shared_expert.w1/w2/w3.weight` and `shared_expert_gate.weight` (1, dim).
    """

    def __init__(self, dim: int, hidden_dim: int, num_experts: int, top_k: int, norm_topk_prob: bool,
                 shared_hidden_dim: int = 0) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must be in [1, num_experts={num_experts}], got {top_k}")
        self.num_experts = num_experts
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.router = nn.Linear(dim, num_experts, bias=False)
        self.experts = GroupedExperts(dim, hidden_dim, num_experts)
        self.shared_expert = FeedForward(dim, shared_hidden_dim) if shared_hidden_dim else None
        self.shared_expert_gate = nn.Linear(dim, 1, bias=False) if shared_hidden_dim else None
        self.dispatcher: Dispatcher = local_dispatch
        # Load-balancing state: plain attributes, not buffers (never in the state dict).
        self.aux_loss: Tensor | None = None  # the last forward's aux loss, differentiable
        # (E + 2,) fp64 since the last pop: assignments per expert, sum of aux losses, forwards.
        # One tensor, updated on device: no host sync and no Python counters for torch.compile.
        self._stats: Tensor | None = None
        self._pending: tuple[Tensor, Tensor] | None = None  # the last forward's (counts, aux loss)

    def route(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x (N, dim) -> top_w (N, k) in x's dtype, top_i (N, k) int64, probs (N, E) fp32."""
        logits = self.router(x)  # (N, E)
        probs = torch.softmax(logits.float(), dim=-1)
        top_w, top_i = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        return top_w.to(x.dtype), top_i, probs

    def forward(self, x: Tensor) -> Tensor:
        # x: (B, T, dim) -> (B, T, dim)
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # (N, dim)
        top_w, top_i, probs = self.route(x)
        counts = torch.bincount(top_i.flatten(), minlength=self.num_experts)  # (E,) int64
        self._record(probs, counts)

        # Sort the N*k (token, slot) pairs by expert; stable, so tokens keep their order per expert.
        order = torch.argsort(top_i.flatten(), stable=True)  # (N*k,)
        token = order // self.top_k  # (N*k,) source token of each sorted row
        y = self.dispatcher(self.experts, x[token], counts)  # (N*k, dim)
        y = y * top_w.flatten()[order, None]
        out = torch.zeros_like(x).index_add_(0, token, y)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out.view(shape)

    def _record(self, probs: Tensor, counts: Tensor) -> None:
        num_tokens = probs.shape[0]
        # f_e sums to top_k over experts, as in transformers (counts / tokens, not / assignments).
        f = counts.float() / max(num_tokens, 1)
        aux_loss = self.num_experts * (f * probs.mean(dim=0)).sum() if num_tokens else probs.sum() * 0
        # Only plain Python bookkeeping from here: a block recomputed by activation checkpointing
        # must run exactly the same tensor ops as its forward (selective checkpointing matches
        # them one by one), and its recomputation must not count the tokens a second time.
        if torch.compiler.is_compiling() or torch._C._current_graph_task_id() == -1:
            self.aux_loss = aux_loss
            self._pending = (counts, aux_loss)

    def _accumulate(self) -> None:
        """Fold the last forward's counts into the running statistics (outside any checkpointed region)."""
        if self._pending is None:
            return
        counts, aux_loss = self._pending
        self._pending = None
        with torch.no_grad():
            row = torch.cat([counts.double(), aux_loss.detach().double().view(1), counts.new_ones(1).double()])
            self._stats = row if self._stats is None else self._stats + row

    @torch.no_grad()
    def init_weights(self, std: float, out_std: float, generator: torch.Generator | None = None) -> None:
        """Router, w1/w3 and the shared gate ~ N(0, std); the experts' and shared expert's w2 ~ N(0, out_std)."""
        nn.init.normal_(self.router.weight, mean=0.0, std=std, generator=generator)
        self.experts.init_weights(std, out_std, generator)
        if self.shared_expert is not None:
            nn.init.normal_(self.shared_expert.w1.weight, mean=0.0, std=std, generator=generator)
            nn.init.normal_(self.shared_expert.w2.weight, mean=0.0, std=out_std, generator=generator)
            nn.init.normal_(self.shared_expert.w3.weight, mean=0.0, std=std, generator=generator)
            nn.init.normal_(self.shared_expert_gate.weight, mean=0.0, std=std, generator=generator)

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, top_k={self.top_k}, norm_topk_prob={self.norm_topk_prob}"


def moe_layers(model: nn.Module) -> list[MoE]:
    """The MoE modules of a model, in module order."""
    return [m for m in model.modules() if isinstance(m, MoE)]


def moe_aux_loss(model: nn.Module) -> Tensor | None:
    """Sum over MoE layers of the last forward's aux loss (differentiable); None for a dense model."""
    layers = moe_layers(model)
    if not layers:
        return None
    losses = [m.aux_loss for m in layers if m.aux_loss is not None]
    if not losses:
        raise ValueError("moe_aux_loss needs a forward pass first: no MoE layer has an aux loss yet")
    return torch.stack(losses).sum()


def record_moe_stats(model: nn.Module) -> None:
    """Add the last forward's load statistics to the running ones; call after every forward
    (the trainer does, per micro-batch). `pop_moe_stats` records a pending forward itself."""
    for m in moe_layers(model):
        m._accumulate()


def pop_moe_stats(model: nn.Module) -> dict[str, float]:
    """Load-balancing statistics since the last call, then reset them. {} for a dense model.

    - "moe/aux_loss": per forward, the sum over layers of the aux loss; averaged over forwards;
    - "moe/load_max", "moe/load_min": per layer, the max (min) over experts of the expert's share
      of top-k assignments times E (1.0 = perfectly balanced); averaged over layers.
    """
    record_moe_stats(model)
    layers = [m for m in moe_layers(model) if m._stats is not None]
    if not layers:
        return {}
    loads, aux = [], []
    for m in layers:
        counts, aux_sum, num_forwards = m._stats[:-2], m._stats[-2], m._stats[-1]
        loads.append(counts / counts.sum().clamp(min=1) * m.num_experts)
        aux.append(aux_sum / num_forwards)
        m._stats = None
    loads_le = torch.stack(loads)  # (L, E)
    # One host transfer for everything.
    values = torch.stack([torch.stack(aux).sum(), loads_le.max(dim=1).values.mean(),
                          loads_le.min(dim=1).values.mean()]).tolist()
    return {"moe/aux_loss": values[0], "moe/load_max": values[1], "moe/load_min": values[2]}

