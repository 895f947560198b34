"""The HF state-dict adapter every native family shares, driven by the family's `KeyMap`.

A family's key map is data: which of our keys is which HF key. The adapter only applies it,
so a new family writes tables, not conversion code:

    top          whole keys outside the blocks      tok_embeddings.weight <-> model.embed_tokens.weight
    block        keys of every block, relative to   attention.wq.weight   <-> self_attn.q_proj.weight
                 layers.{i}. / model.layers.{i}.
    layer_keys   block keys that only some layers have, by layer kind ("dense", "MoE"), with
                 `layer_kind(args, i)` naming the kind of layer i
    experts      a grouped tensor of ours (E, ...) <-> E per-expert HF keys, "{j}" = expert index:
                 moe.experts.w1 (E, I, D) <-> mlp.experts.{j}.gate_proj.weight, j < E
    fused_experts  HF grouped layouts read (never written): transformers 5 keeps experts fused in
                 memory, mlp.experts.gate_up_proj (E, 2I, D) = [gate; up] along dim 1 ->
                 (moe.experts.w1, moe.experts.w3), and mlp.experts.down_proj -> moe.experts.w2
    hf_aliases   other HF spellings of block keys, read (never written) as the canonical one:
                 MiniMax-M2's hub folders say block_sparse_moe.gate.weight, transformers 5's
                 in-memory model (and a folder saved without the original format) mlp.gate.weight
    packed       an HF block tensor that holds several of ours in another layout, read and written
                 (`Packed`: its parts and the two conversions): gpt-oss's mlp.experts.gate_up_proj
                 (E, D, 2I), gate and up interleaved along the last dim, is (moe.experts.w1,
                 moe.experts.w3), each (E, I, D)

Values pass through untouched except for experts (so the adapter works on DTensors and on
gradients as well as on weights): `to_hf` writes E per-expert copies of a grouped tensor (copies,
not views: safetensors refuses tensors that share memory) and needs all E experts, so gather
expert-parallel shards first; `from_hf` stacks per-expert tensors, and is stateful: the experts of
one grouped tensor may arrive over several calls (models/hf.py loads one key per call), and the
call that completes it returns it (`pending()` lists incomplete ones).

Multi-token-prediction layers: checkpoints of GLM-4.5 and DeepSeek-V3 store their MTP module(s)
as layers n_layers .. n_layers + args.num_mtp_layers - 1 (transformers does not build them
either); `from_hf` drops those keys. Any other layer index >= n_layers is still an error.

Tied embeddings: the top key `tied_head` ("output.weight") does not exist, `to_hf` writes no
lm_head and refuses an output.weight, `from_hf` drops a stored lm_head (some checkpoints carry
the copy). Unknown keys, layer indices >= n_layers, keys that do not fit their layer's kind and
expert indices >= E raise ValueError naming the key.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

# The keys of common/decoder.py's DecoderLM (embedding, final norm, untied head) under HF's names.
DECODER_KEYS: dict[str, str] = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# common/ffn.py's SwiGLU FeedForward as a block's `feed_forward`, HF's `mlp`.
SWIGLU_KEYS: dict[str, str] = {
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
}
# common/moe.py's grouped SwiGLU experts (E, I, D) / (E, D, I) as hub folders hold them, one key
# per expert j under `mlp.experts` (KeyMap.experts), and the fused tensors transformers 5 writes,
# read only (KeyMap.fused_experts): gate_up_proj (E, 2I, D) = [w1; w3], down_proj = w2.
EXPERT_KEYS: dict[str, str] = {
    "moe.experts.w1": "mlp.experts.{j}.gate_proj.weight",
    "moe.experts.w2": "mlp.experts.{j}.down_proj.weight",
    "moe.experts.w3": "mlp.experts.{j}.up_proj.weight",
}
FUSED_EXPERT_KEYS: dict[str, tuple[str, ...]] = {
    "mlp.experts.gate_up_proj": ("moe.experts.w1", "moe.experts.w3"),
    "mlp.experts.down_proj": ("moe.experts.w2",),
}
# The DeepSeek-V3 lineage's MoE layer outside the experts (DeepSeek-V3, GLM-4.5, GLM-5): the
# sigmoid router, its score-correction bias and the shared experts.
ROUTED_MOE_KEYS: dict[str, str] = {
    "moe.router.weight": "mlp.gate.weight",
    "moe.expert_bias": "mlp.gate.e_score_correction_bias",
    "moe.shared_expert.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "moe.shared_expert.w2.weight": "mlp.shared_experts.down_proj.weight",
    "moe.shared_expert.w3.weight": "mlp.shared_experts.up_proj.weight",
}


@dataclass(frozen=True)
class Packed:
    """Our block tensors `parts` (block-relative names) as one HF tensor: `unpack(hf) -> parts`,
    `pack(*parts) -> hf`. `to_hf` needs every part of a layer at once."""

    parts: tuple[str, ...]
    unpack: Callable[[Tensor], tuple[Tensor, ...]]
    pack: Callable[..., Tensor]


@dataclass(frozen=True)
class KeyMap:
    """One family's explicit key map between our state-dict keys and HF's (see the module docstring).

    `label` / `hf_label` name the family in errors about our keys / HF keys. Block keys are
    relative to `f"{layers_prefix}.{i}."` (ours) and `f"{hf_layers_prefix}.{i}."` (HF). A family
    with `layer_keys` gives `layer_kind`; a family with experts has `args.num_experts`, and its
    experts live in the layers of kind `expert_kind` (None: every layer).
    """

    label: str
    hf_label: str
    top: Mapping[str, str]
    block: Mapping[str, str]
    layer_keys: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    layer_kind: Callable[[Any, int], str] | None = None
    experts: Mapping[str, str] = field(default_factory=dict)
    fused_experts: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    hf_aliases: Mapping[str, str] = field(default_factory=dict)
    packed: Mapping[str, Packed] = field(default_factory=dict)
    expert_kind: str | None = None
    tied_head: str = "output.weight"
    layers_prefix: str = "layers"
    hf_layers_prefix: str = "model.layers"

    def __post_init__(self) -> None:
        assert not self.layer_keys or self.layer_kind is not None, f"{self.label}: layer_keys need a layer_kind"
        assert all("{j}" in name for name in self.experts.values()), f"{self.label}: expert keys need a {{j}}"
        assert self.tied_head in self.top, f"{self.label}: tied_head {self.tied_head!r} is not a top key"


class StateDictAdapter:
    """Maps state dicts between our layout and HF's by a family's `key_map` (a class attribute).

    A family subclasses it and sets `key_map`; the subclass is the family's `state_dict_adapter`,
    constructed as `Adapter(args)` with `to_hf`, `from_hf` and `pending`.
    """

    key_map: KeyMap

    def __init__(self, args: Any) -> None:
        km = self.key_map
        self.args = args
        # Block-relative name -> (the other side's name, the kind of layer it needs or None).
        self._to_hf_block: dict[str, tuple[str, str | None]] = {k: (v, None) for k, v in km.block.items()}
        for kind, keys in km.layer_keys.items():
            self._to_hf_block.update({k: (v, kind) for k, v in keys.items()})
        self._from_hf_block = {v: (k, kind) for k, (v, kind) in self._to_hf_block.items()}
        self._from_hf_top = {v: k for k, v in km.top.items()}
        self._hf_tied_head = km.top[km.tied_head]
        self._ours_block = re.compile(rf"{re.escape(km.layers_prefix)}\.(\d+)\.(.+)")
        self._hf_block = re.compile(rf"{re.escape(km.hf_layers_prefix)}\.(\d+)\.(.+)")
        self._hf_expert = [(re.compile(re.escape(v).replace(re.escape("{j}"), r"(\d+)")), k)
                           for k, v in km.experts.items()]
        self._partial: dict[str, dict[int, Tensor]] = {}  # our grouped key -> {expert index: tensor}
        self._packed_part = {part: hf for hf, packing in km.packed.items() for part in packing.parts}

    def _layer(self, index: str, key: str) -> int:
        if int(index) >= self.args.n_layers:
            raise ValueError(f"state-dict key {key!r} names layer {index}, but the model has {self.args.n_layers}")
        return int(index)

    def _block_layer(self, index: str, kind: str | None, key: str) -> int:
        """The layer index of a block key, checked against n_layers and (with `kind`) the layer's kind."""
        layer = self._layer(index, key)
        if kind is not None:
            actual = self.key_map.layer_kind(self.args, layer)
            if actual != kind:
                raise ValueError(f"state-dict key {key!r} does not fit layer {layer}, which is a {actual} layer")
        return layer

    def to_hf(self, state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
        km, out = self.key_map, {}
        packing: dict[tuple[int, str], dict[str, Tensor]] = {}  # (layer, HF name) -> {our part: value}
        for key, value in state_dict.items():
            if key == km.tied_head and self.args.tie_embeddings:
                raise ValueError(f"state dict has {key!r} but the model ties its embeddings")
            m = self._ours_block.fullmatch(key)
            name = m.group(2) if m else None
            if key in km.top:
                out[km.top[key]] = value
            elif name in self._to_hf_block:
                hf_name, kind = self._to_hf_block[name]
                out[f"{km.hf_layers_prefix}.{self._block_layer(m.group(1), kind, key)}.{hf_name}"] = value
            elif name in km.experts:
                layer = self._block_layer(m.group(1), km.expert_kind, key)
                out.update(self._split_experts(layer, km.experts[name], value, key))
            elif name in self._packed_part:
                layer = self._block_layer(m.group(1), km.expert_kind, key)
                packing.setdefault((layer, self._packed_part[name]), {})[name] = value
            else:
                raise ValueError(f"unknown {km.label} state-dict key {key!r}")
        for (layer, hf_name), parts in packing.items():
            wanted = km.packed[hf_name].parts
            if set(parts) != set(wanted):
                missing = [f"{km.layers_prefix}.{layer}.{p}" for p in wanted if p not in parts]
                raise ValueError(f"{km.label}: {missing} are needed with the rest of {hf_name!r} to write it")
            out[f"{km.hf_layers_prefix}.{layer}.{hf_name}"] = km.packed[hf_name].pack(*(parts[p] for p in wanted))
        return out

    def _split_experts(self, layer: int, template: str, value: Tensor, key: str) -> dict[str, Tensor]:
        num_experts = self.args.num_experts
        if value.shape[0] != num_experts:
            raise ValueError(f"{key!r} holds {value.shape[0]} experts, the model has {num_experts} "
                             f"(gather expert-parallel shards before converting)")
        prefix = f"{self.key_map.hf_layers_prefix}.{layer}"
        return {f"{prefix}.{template.format(j=j)}": value[j].clone() for j in range(num_experts)}

    def from_hf(self, state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
        km, out = self.key_map, {}
        for key, value in state_dict.items():
            if key == self._hf_tied_head and self.args.tie_embeddings:
                continue  # the tied head is tok_embeddings.weight itself
            m = self._hf_block.fullmatch(key)
            name = km.hf_aliases.get(m.group(2), m.group(2)) if m else None
            if m and self._is_mtp_layer(int(m.group(1))):
                continue  # a multi-token-prediction module: not part of the causal LM
            if key in self._from_hf_top:
                out[self._from_hf_top[key]] = value
            elif name in self._from_hf_block:
                ours, kind = self._from_hf_block[name]
                out[f"{km.layers_prefix}.{self._block_layer(m.group(1), kind, key)}.{ours}"] = value
            elif name is not None and (expert := self._match_expert(name)) is not None:
                layer = self._block_layer(m.group(1), km.expert_kind, key)
                grouped, j = expert
                out.update(self._add_expert(f"{km.layers_prefix}.{layer}.{grouped}", j, value, key))
            elif name in km.packed:
                layer = self._block_layer(m.group(1), km.expert_kind, key)
                parts = km.packed[name]
                out.update({f"{km.layers_prefix}.{layer}.{part}": t
                            for part, t in zip(parts.parts, parts.unpack(value))})
            elif name in km.fused_experts:
                layer = self._block_layer(m.group(1), km.expert_kind, key)
                parts = km.fused_experts[name]
                # (E, n * rows, ...) holds the n grouped tensors one after the other along dim 1.
                chunks = (value,) if len(parts) == 1 else value.chunk(len(parts), dim=1)
                out.update({f"{km.layers_prefix}.{layer}.{part}": chunk for part, chunk in zip(parts, chunks)})
            else:
                raise ValueError(f"unknown HF {km.hf_label} state-dict key {key!r}")
        return out

    def _is_mtp_layer(self, layer: int) -> bool:
        n = self.args.n_layers
        return n <= layer < n + getattr(self.args, "num_mtp_layers", 0)

    def _match_expert(self, name: str) -> tuple[str, int] | None:
        """(our grouped key, expert index) of a block-relative per-expert HF name, or None."""
        for pattern, grouped in self._hf_expert:
            if (e := pattern.fullmatch(name)) is not None:
                return grouped, int(e.group(1))
        return None

    def _add_expert(self, grouped_key: str, expert: int, value: Tensor, key: str) -> dict[str, Tensor]:
        num_experts = self.args.num_experts
        if expert >= num_experts:
            raise ValueError(f"state-dict key {key!r} names expert {expert}, but the model has {num_experts}")
        parts = self._partial.setdefault(grouped_key, {})
        if expert in parts:
            raise ValueError(f"state-dict key {key!r} appears twice")
        parts[expert] = value
        if len(parts) < num_experts:
            return {}
        del self._partial[grouped_key]
        return {grouped_key: torch.stack([parts[j] for j in range(num_experts)])}

    def pending(self) -> list[str]:
        """Grouped keys with some but not all of their experts seen by `from_hf`."""
        return sorted(self._partial)
