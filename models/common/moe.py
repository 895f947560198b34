"""Mixture-of-experts feed-forward with top-k routing, shared by the MoE families.

    router:   logits = x @ router.T               (N, E) in the activation dtype (fp32 with routing.fp32)
              probs  = softmax(logits.float())    fp32, over all E experts        (score "softmax")
                       sigmoid(logits.float())    each expert on its own          (score "sigmoid")
              top_i  = topk(probs + bias, k)      the bias (expert_bias, DeepSeek's score-correction
                                                  bias) steers the choice only; with num_groups > 1
                                                  only the topk_groups best groups (a group scores
                                                  the sum of its two best experts) are eligible
              top_w  = probs[top_i]               optionally renormalised to sum 1 (norm_topk_prob,
                                                  + routing.norm_eps), times routing.scale
    experts:  y_t = sum_j top_w[t, j] * SwiGLU_{top_i[t, j]}(x_t)
    shared:   + sigmoid(x @ g) * SwiGLU_shared(x) (Qwen2-MoE; off for Qwen3-MoE), or without the
              gate (shared_gate=False: DeepSeek-V3, GLM-4.5's shared experts)

`Routing` holds the choices: Qwen3-MoE is softmax + norm_topk_prob; MiniMax-M2 is sigmoid + bias
+ norm; DeepSeek-V3 and GLM-4.5 are sigmoid + bias + groups + norm (eps 1e-20) + scale, in fp32;
gpt-oss is a router with a trained bias, softmax + norm (its softmax over the k best logits is
the renormalised top-k of the full softmax), and experts with biases and a clamped SwiGLU.
The bias is a frozen parameter (requires_grad=False; in checkpoints, weight sync and exports
like any weight, never updated by the optimizer: RL keeps a released model's balancing bias).

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
k over experts; P_e = mean router probability of e; a sigmoid router's scores are normalised to
sum 1 per token first), which is what transformers' `load_balancing_loss_func` returns for a
single softmax layer, plus detached per-expert assignment
counts. `moe_aux_loss(model)` sums the aux losses of the last forward (transformers instead
pools the counts and probabilities of all layers before multiplying; the two agree for one
MoE layer). `record_moe_stats(model)` (after every forward) accumulates the counts and
`pop_moe_stats(model)` reports and resets them. Every token of the batch counts, padding
included: the model never sees a padding mask. Statistics are per rank (the trainer averages
them over ranks); a block recomputed under activation checkpointing records nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from meshrl.models.common.ffn import FeedForward


def _grouped_mm_ok(x: Tensor, w: Tensor) -> bool:
    """Whether torch._grouped_mm can run these experts: Hopper or newer, bf16, 16-byte aligned rows."""
    return (hasattr(torch, "_grouped_mm") and x.is_cuda and x.dtype == torch.bfloat16 and w.dtype == torch.bfloat16
            and torch.cuda.get_device_capability(x.device) >= (9, 0)
            and x.shape[-1] % 8 == 0 and w.shape[1] % 8 == 0)


@dataclass(frozen=True)
class ClampedSwiGLU:
    """gpt-oss's expert activation: gate = min(gate, limit), up = clamp(up, -limit, limit),
    out = (up + 1) * gate * sigmoid(alpha * gate)."""

    alpha: float = 1.702
    limit: float = 7.0

    def __call__(self, gate: Tensor, up: Tensor) -> Tensor:
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


def _swiglu(gate: Tensor, up: Tensor) -> Tensor:
    return F.silu(gate) * up


class GroupedExperts(nn.Module):
    """`num_experts` SwiGLU experts with grouped weights; expert e is w2[e](act(w1[e] x, w3[e] x)),
    act = silu(gate) * up, or `activation` (gpt-oss: `ClampedSwiGLU`); with `bias`, every
    projection adds its expert's bias (b1 (E, hidden), b2 (E, dim), b3 (E, hidden)).

    The module runs experts on rows already grouped by expert. After expert parallelism it
    holds only its rank's experts (`num_experts` = E / ep); the rest of the model is unaware.
    Every parameter has the expert on dim 0 (expert parallelism splits them all).
    """

    def __init__(self, dim: int, hidden_dim: int, num_experts: int, bias: bool = False,
                 activation: ClampedSwiGLU | None = None) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        if bias:
            self.b1 = nn.Parameter(torch.empty(num_experts, hidden_dim))
            self.b2 = nn.Parameter(torch.empty(num_experts, dim))
            self.b3 = nn.Parameter(torch.empty(num_experts, hidden_dim))
        self.has_bias = bias
        self.act = activation if activation is not None else _swiglu
        # Benchmarks may turn the grouped GEMM off to time the per-expert loop.
        self.use_grouped_mm = True

    def forward(self, x: Tensor, counts: Tensor) -> Tensor:
        # x: (M, dim) rows grouped by expert, ascending; counts: (num_experts,) int64 summing to M -> (M, dim)
        assert counts.shape == (self.num_experts,), f"counts {tuple(counts.shape)} vs {self.num_experts} experts"
        w1, w2, w3 = self.w1, self.w2, self.w3
        if self.use_grouped_mm and _grouped_mm_ok(x, w1):
            # One kernel per projection over all groups; offsets are cumulative row ends (no host sync).
            offs = counts.cumsum(0).to(torch.int32)
            g = torch._grouped_mm(x, w1.transpose(-2, -1), offs=offs)
            u = torch._grouped_mm(x, w3.transpose(-2, -1), offs=offs)
            if self.has_bias:
                row_expert = torch.repeat_interleave(torch.arange(self.num_experts, device=x.device), counts,
                                                     output_size=x.shape[0])
                g, u = g + self.b1[row_expert], u + self.b3[row_expert]
            out = torch._grouped_mm(self.act(g, u), w2.transpose(-2, -1), offs=offs)
            return out + self.b2[row_expert] if self.has_bias else out
        # Every expert runs, also on zero rows: its weights then get a zero gradient instead of
        # none, so all ranks reduce the same gradients under FSDP whatever the routing.
        outs = []
        for e, xe in enumerate(torch.split(x, counts.tolist())):
            b1, b2, b3 = (self.b1[e], self.b2[e], self.b3[e]) if self.has_bias else (None, None, None)
            outs.append(F.linear(self.act(F.linear(xe, w1[e], b1), F.linear(xe, w3[e], b3)), w2[e], b2))
        return torch.cat(outs) if outs else x.new_zeros(0, x.shape[-1])

    @torch.no_grad()
    def init_weights(self, std: float, out_std: float, generator: torch.Generator | None = None) -> None:
        """w1, w3 ~ N(0, std); w2 (the residual output projection) ~ N(0, out_std)."""
        nn.init.normal_(self.w1, mean=0.0, std=std, generator=generator)
        nn.init.normal_(self.w2, mean=0.0, std=out_std, generator=generator)
        nn.init.normal_(self.w3, mean=0.0, std=std, generator=generator)
        if self.has_bias:
            for b in (self.b1, self.b2, self.b3):
                nn.init.zeros_(b)

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, dim={self.w1.shape[2]}, hidden_dim={self.w1.shape[1]}"


# A dispatcher runs rows grouped by (global) expert through the experts:
# (experts, x_sorted (M, dim), counts (E,) int64) -> (M, dim).
Dispatcher = Callable[[GroupedExperts, Tensor, Tensor], Tensor]


def local_dispatch(experts: GroupedExperts, x: Tensor, counts: Tensor) -> Tensor:
    """All experts are on this rank: run them in place."""
    return experts(x, counts)


@dataclass(frozen=True)
class Routing:
    """How a MoE layer scores, picks and weights its experts (see the module docstring)."""

    score: Literal["softmax", "sigmoid"] = "softmax"
    norm_topk_prob: bool = False
    bias: bool = False  # a score-correction bias per expert, added for the choice only
    num_groups: int = 1  # grouped top-k (DeepSeek-V3's n_group) ...
    topk_groups: int = 1  # ... of which this many groups are eligible (topk_group)
    scale: float = 1.0  # routed_scaling_factor, applied to the final weights
    norm_eps: float = 0.0  # added to the renormalising sum (DeepSeek-V3, GLM-4.5: 1e-20)
    fp32: bool = False  # router matmul in fp32 (x.float() @ router.float().T)
    router_bias: bool = False  # a trained bias on the router logits (gpt-oss's router.bias)

    def check(self, num_experts: int, top_k: int) -> None:
        if self.score not in ("softmax", "sigmoid"):
            raise ValueError(f"routing score must be 'softmax' or 'sigmoid', got {self.score!r}")
        if self.num_groups < 1 or num_experts % self.num_groups != 0:
            raise ValueError(f"{num_experts} experts do not split into {self.num_groups} groups (n_group)")
        if self.num_groups > 1 and num_experts // self.num_groups < 2:
            raise ValueError("grouped routing scores a group by its two best experts: each group needs >= 2")
        if not 1 <= self.topk_groups <= self.num_groups:
            raise ValueError(f"topk_group must be in [1, n_group={self.num_groups}], got {self.topk_groups}")
        if top_k > self.topk_groups * (num_experts // self.num_groups):
            raise ValueError(f"top_k {top_k} exceeds the experts of the {self.topk_groups} eligible groups")


class MoE(nn.Module):
    """Top-k routed SwiGLU experts, with an optional shared expert (sigmoid-gated or not).

    Parameters: `router.weight` (E, dim), `experts.w1/w2/w3`, with `routing.bias` the frozen
    `expert_bias` (E,), and with a shared expert `shared_expert.w1/w2/w3.weight` (and, gated,
    `shared_expert_gate.weight` (1, dim)). `routing` defaults to softmax scores with
    `norm_topk_prob`; given, it decides (its own norm_topk_prob included).
    """

    def __init__(self, dim: int, hidden_dim: int, num_experts: int, top_k: int, norm_topk_prob: bool = False,
                 shared_hidden_dim: int = 0, *, routing: Routing | None = None, shared_gate: bool = True,
                 expert_biases: bool = False, activation: ClampedSwiGLU | None = None) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must be in [1, num_experts={num_experts}], got {top_k}")
        self.routing = routing if routing is not None else Routing(norm_topk_prob=norm_topk_prob)
        self.routing.check(num_experts, top_k)
        self.num_experts = num_experts
        self.top_k = top_k
        self.norm_topk_prob = self.routing.norm_topk_prob
        self.router = nn.Linear(dim, num_experts, bias=self.routing.router_bias)
        self.expert_bias = nn.Parameter(torch.zeros(num_experts), requires_grad=False) if self.routing.bias else None
        self.experts = GroupedExperts(dim, hidden_dim, num_experts, bias=expert_biases, activation=activation)
        self.shared_expert = FeedForward(dim, shared_hidden_dim) if shared_hidden_dim else None
        gated = shared_hidden_dim and shared_gate
        self.shared_expert_gate = nn.Linear(dim, 1, bias=False) if gated else None
        self.dispatcher: Dispatcher = local_dispatch
        # Load-balancing state: plain attributes, not buffers (never in the state dict).
        self.aux_loss: Tensor | None = None  # the last forward's aux loss, differentiable
        # (E + 2,) fp64 since the last pop: assignments per expert, sum of aux losses, forwards.
        # One tensor, updated on device: no host sync and no Python counters for torch.compile.
        self._stats: Tensor | None = None
        self._pending: tuple[Tensor, Tensor] | None = None  # the last forward's (counts, aux loss)

    def route(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x (N, dim) -> top_w (N, k) in x's dtype, top_i (N, k) int64, probs (N, E) fp32 (the
        load-balancing probabilities: softmax, or a sigmoid router's scores normalised per token)."""
        r = self.routing
        if r.fp32:
            bias = None if self.router.bias is None else self.router.bias.float()
            logits = F.linear(x.float(), self.router.weight.float(), bias)  # (N, E)
        else:
            logits = self.router(x)
        if r.score == "softmax":
            scores = probs = torch.softmax(logits.float(), dim=-1)
        else:
            scores = torch.sigmoid(logits.float())
            probs = scores / scores.sum(dim=-1, keepdim=True)
        choice = scores if self.expert_bias is None else scores + self.expert_bias.float()
        top_i = torch.topk(self._eligible(choice), self.top_k, dim=-1).indices
        top_w = scores.gather(1, top_i)
        if r.norm_topk_prob:
            top_w = top_w / (top_w.sum(dim=-1, keepdim=True) + r.norm_eps)
        if r.scale != 1.0:
            top_w = top_w * r.scale
        return top_w.to(x.dtype), top_i, probs

    def _eligible(self, choice: Tensor) -> Tensor:
        """Grouped top-k: -inf outside the topk_groups groups whose two best scores sum highest."""
        r = self.routing
        if r.num_groups == 1:
            return choice
        N = choice.shape[0]
        grouped = choice.view(N, r.num_groups, -1)  # (N, G, E/G)
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # (N, G)
        best = group_scores.topk(r.topk_groups, dim=-1).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)  # (N, G)
        return grouped.masked_fill(~keep[..., None], float("-inf")).view(N, -1)

    def forward(self, x: Tensor) -> Tensor:
        # x: (B, T, dim) -> (B, T, dim)
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # (N, dim)
        top_w, top_i, probs = self.route(x)
        # (E,) int64; a scatter, not bincount, whose output shape depends on the data (a graph break)
        counts = top_i.new_zeros(self.num_experts).scatter_add_(0, top_i.flatten(), torch.ones_like(top_i.flatten()))
        self._record(probs, counts)

        # Sort the N*k (token, slot) pairs by expert; stable, so tokens keep their order per expert.
        order = torch.argsort(top_i.flatten(), stable=True)  # (N*k,)
        token = order // self.top_k  # (N*k,) source token of each sorted row
        y = self.dispatcher(self.experts, x[token], counts)  # (N*k, dim)
        y = y * top_w.flatten()[order, None]
        out = torch.zeros_like(x).index_add_(0, token, y)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
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
        if self.shared_expert_gate is not None:
            nn.init.normal_(self.shared_expert_gate.weight, mean=0.0, std=std, generator=generator)
        if self.expert_bias is not None:
            nn.init.zeros_(self.expert_bias)

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, top_k={self.top_k}, routing={self.routing}"


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

