"""The generic path: any transformers causal LM we have not written natively, behind our model contract.

`HFCausalLM` wraps a `transformers.AutoModelForCausalLM` built from an HF config dict and exposes
what the trainer, the engine and parallel/ expect of a models/ family:

- `hidden(tokens, positions, attn)`, `output_weight`, `forward(tokens, positions, attn, head)`;
- `layers`: an `nn.ModuleDict` "0".."n-1" *view* over the HF decoder layers (FSDP2 wraps each,
  then the root). It is a property, not a registered child, so every parameter keeps one name;
- `init_weights(seed)`: transformers' own initialisation of that architecture, seeded.

Attention is routed into our `AttentionContext`: an attention function registered with
transformers' `AttentionInterface` under "meshrl" (at the first build, never at import) receives
q, k, v after RoPE and norms, and calls `attn.attend(module.layer_idx, q, k, v)`. The context
travels down as a forward keyword (transformers >= 5 hands its **kwargs to the attention
function). HF's causal-mask construction is skipped for an implementation it does not know, so
no (T, T) mask is built twice. HF passes its softmax `scaling`; our contract is 1/sqrt(D), so q is
rescaled by scaling * sqrt(D) when they differ (e.g. Granite's attention_multiplier).

What cannot be served correctly through that contract is refused with a ValueError when the model
is built: sliding-window / chunked / linear-attention layers, attention or final logit
soft-capping, non-causal and encoder-decoder models, dropout (the trainer and the engine must
compute the same logprobs), an LM head with a bias, and models without `model.layers` decoder
layers whose `self_attn` carries its `layer_idx`. A model type whose logits are a known scalar
multiple of `lm_head(hidden)` (Granite, Cohere) has the scalar folded into `hidden`, so
`forward == F.linear(hidden, output_weight)` still holds.

State dict: ours is exactly transformers' with the wrapper prefix "hf." (`GenericStateDictAdapter`
adds/strips it, knows every valid key from a meta instance, and stores a tied LM head once).
Non-persistent buffers (RoPE inverse frequencies) are derived state: they are computed by
transformers when the model first leaves the meta device and are then kept in the dtype the
architecture created them in, so `model.to(torch.bfloat16)` never rounds RoPE frequencies.

Requires transformers >= 5. Nothing here is registered at import time: `models/hf.py` asks
`family_for(model_type, impl)` which implementation to use, and gets `GENERIC_FAMILY` for this one.
"""

from __future__ import annotations

import json
import logging
import math
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from meshrl.models import MODEL_FAMILIES, ModelFamily
from meshrl.models.common.attention import AttentionContext, CausalAttention, OutputHead

Impl = Literal["auto", "native", "hf"]
log = logging.getLogger("meshrl")
ATTN_IMPLEMENTATION = "meshrl"
# The forward keyword that carries our AttentionContext down to `_meshrl_attention`.
_ATTN_KWARG = "meshrl_attn"
PREFIX = "hf."

# Model types whose CausalLM multiplies lm_head(hidden) by a config scalar: (attribute, inverse).
# Attribute names alone are ambiguous across families (hyperclovax multiplies by `logits_scaling`,
# Granite divides by it), hence the explicit table; any other type carrying one is refused.
_LOGIT_SCALES: dict[str, tuple[str, bool]] = {
    "granite": ("logits_scaling", True),
    "granitemoe": ("logits_scaling", True),
    "granitemoeshared": ("logits_scaling", True),
    "cohere": ("logit_scale", False),
    "hyperclovax": ("logits_scaling", False),
}
_SCALE_ATTRS = ("logits_scaling", "logit_scale")
_SOFTCAP_ATTRS = ("attn_logit_softcapping", "final_logit_softcapping", "logit_softcapping")
_NO_DROPOUT = "dropout is not supported (the trainer and the engine must compute the same logprobs): set it to 0"


def resolve_impl(model_type: str | None, impl: Impl = "auto",
                 config: dict[str, Any] | None = None) -> Literal["native", "hf"]:
    """Which implementation serves `model_type`: ours ("native") or the generic wrapper ("hf").

    auto: native when the type is in MODEL_FAMILIES and (given the HF `config` dict) the native
    family accepts that config, else hf: a valid config that our file does not implement (e.g.
    Qwen3 with attention_bias=true) falls back to transformers' modeling code. native: an
    unregistered type is an error (and with `config`, so is one the family refuses: its
    ValueError). hf: always the generic wrapper.
    """
    if impl not in ("auto", "native", "hf"):
        raise ValueError(f"model impl must be 'auto', 'native' or 'hf', got {impl!r}")
    if not model_type:
        raise ValueError("the HF config has no model_type")
    if impl == "hf":
        return "hf"
    if model_type in MODEL_FAMILIES:
        if config is not None:
            refusal = native_refusal(config)
            if refusal is not None and impl == "auto":
                log.info("model_type %r: the native implementation refuses this config (%s); using the generic "
                         "transformers path", model_type, refusal)
                return "hf"
            if refusal is not None:
                raise ValueError(f"impl='native': {refusal} (impl='auto' would use the generic transformers path)")
        return "native"
    if impl == "native":
        raise ValueError(f"impl='native' but meshrl has no native implementation of model_type {model_type!r} "
                         f"(native: {sorted(MODEL_FAMILIES)}); use impl='auto' or 'hf' for the transformers wrapper")
    return "hf"


def native_refusal(config: dict[str, Any]) -> str | None:
    """Why the native family of `config`'s model_type cannot build it (its from_hf_config's
    ValueError message), or None when it can. Only reads the config."""
    family = MODEL_FAMILIES[config["model_type"]]
    try:
        family.args_cls.from_hf_config(config)
    except ValueError as e:
        return str(e)
    return None


def family_for(model_type: str | None, impl: Impl = "auto", config: dict[str, Any] | None = None) -> ModelFamily:
    """The family that builds `model_type` under `impl` (see `resolve_impl`): a native one or `GENERIC_FAMILY`."""
    if resolve_impl(model_type, impl, config) == "native":
        return MODEL_FAMILIES[model_type]
    return GENERIC_FAMILY


def native_ep_families() -> list[str]:
    """The model types with a native implementation that has expert parallelism (a plan with "ep")."""
    return sorted(name for name, family in MODEL_FAMILIES.items() if "ep" in family.parallel_plan)


def check_expert_parallel(model_type: str, impl: Literal["native", "hf"], ep: int) -> None:
    """ValueError, before anything starts, for expert parallelism the implementation cannot do:
    the generic path has no expert parallelism, and a native dense family has no experts."""
    if ep <= 1:
        return
    families = ", ".join(native_ep_families())
    if impl == "hf":
        raise ValueError(f"trainer.parallel.ep = {ep}: model_type {model_type!r} runs on the generic transformers "
                         f"path, which has no expert parallelism; native families with expert parallelism: "
                         f"{families}")
    if "ep" not in MODEL_FAMILIES[model_type].parallel_plan:
        raise ValueError(f"trainer.parallel.ep = {ep}: model_type {model_type!r} has no experts (expert "
                         f"parallelism needs a MoE family: {families})")


def _transformers():
    import transformers

    major = int(transformers.__version__.split(".")[0])
    if major < 5:
        raise ValueError(f"the generic HF model path needs transformers >= 5 (it forwards attention kwargs and "
                         f"initialises on demand); found {transformers.__version__}")
    return transformers


# --------------------------------------------------------------------------------------------
# Args
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GenericArgs:
    """An HF `config.json` dict, held as canonical JSON so the args stay immutable and comparable."""

    config_json: str

    @property
    def config(self) -> dict[str, Any]:
        """A fresh copy of the HF config dict."""
        return json.loads(self.config_json)

    @property
    def model_type(self) -> str:
        return self.config["model_type"]

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> GenericArgs:
        """Hold an HF config dict (as read from config.json or `PretrainedConfig.to_dict()`)."""
        if not config.get("model_type"):
            raise ValueError("the HF config has no model_type")
        return cls(json.dumps(config, sort_keys=True, default=str))

    def to_hf_config(
        self,
        dtype: torch.dtype | str = torch.float32,
        bos_token_id: int | None = None,
        eos_token_id: int | list[int] | None = None,
        pad_token_id: int | None = None,
    ) -> dict[str, Any]:
        """The held config with the saved dtype; token ids are overwritten only where given."""
        config = self.config
        dtype_name = str(dtype).removeprefix("torch.")
        config["dtype"] = dtype_name
        config.pop("torch_dtype", None)  # the 4.x spelling would contradict `dtype`
        for key, value in (("bos_token_id", bos_token_id), ("eos_token_id", eos_token_id),
                           ("pad_token_id", pad_token_id)):
            if value is not None:
                config[key] = value
        return config


def _hf_config(args: GenericArgs):
    """The transformers config object; unknown model types raise transformers' own error."""
    transformers = _transformers()
    config = args.config
    model_type = config.pop("model_type")
    return transformers.AutoConfig.for_model(model_type, **config)


def check_hf_config(hf_config) -> None:
    """Refuse, from the config alone, models the generic path cannot serve correctly (ValueError)."""
    model_type = hf_config.model_type
    if getattr(hf_config, "is_encoder_decoder", False):
        raise ValueError(f"{model_type}: encoder-decoder models are not supported (decoder-only causal LMs only)")
    if getattr(hf_config, "is_causal", True) is False:
        raise ValueError(f"{model_type}: the config sets is_causal=False; only causal attention is supported")
    # Multimodal and hybrid configs (Qwen3.5) keep the decoder's settings in text_config.
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    layer_types = getattr(text, "layer_types", None) or []
    other = sorted(set(layer_types) - {"full_attention"})
    if other:
        raise ValueError(f"{model_type}: layer types {other} are not supported (only full causal attention; "
                         "sliding-window, chunked and linear-attention layers need their own attention context)")
    if not layer_types and getattr(text, "sliding_window", None) is not None:
        raise ValueError(f"{model_type}: sliding_window={text.sliding_window} is not supported "
                         "(set it to null if the model was trained without one)")
    for attr in _SOFTCAP_ATTRS:
        if getattr(text, attr, None) not in (None, 0, 0.0):
            raise ValueError(f"{model_type}: {attr}={getattr(text, attr)} (logit soft-capping) is not supported")
    for attr in _SCALE_ATTRS:
        value = getattr(text, attr, None)
        known = _LOGIT_SCALES.get(model_type, (None,))[0] == attr
        if value not in (None, 1, 1.0) and not known:
            raise ValueError(f"{model_type}: {attr}={value} scales the logits in a way meshrl does not know")
    if (getattr(text, "attention_dropout", 0.0) or 0.0) > 0:
        raise ValueError(f"{model_type}: attention_dropout={text.attention_dropout}; {_NO_DROPOUT}")


def check_generic_config(config: dict[str, Any]) -> None:
    """Check an HF config dict for the generic path without building the model (ValueError)."""
    check_hf_config(_hf_config(GenericArgs.from_hf_config(config)))


# --------------------------------------------------------------------------------------------
# Attention routing
# --------------------------------------------------------------------------------------------


def _meshrl_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """transformers attention function: query (B, Hq, T, D), key/value (B, Hkv, T, D) -> (B, T, Hq, D)."""
    attn: AttentionContext | None = kwargs.get(_ATTN_KWARG)
    if attn is None:
        raise ValueError("a model built for meshrl attention was called without an AttentionContext: "
                         "call it through HFCausalLM.hidden / forward")
    if attention_mask is not None:
        raise ValueError(f"layer {module.layer_idx}: the model passed its own attention mask, which the generic "
                         "path cannot honour (the AttentionContext decides the pattern)")
    if dropout:
        raise ValueError(f"attention dropout {dropout} is not supported")
    for name in ("sliding_window", "softcap", "s_aux"):
        if kwargs.get(name) is not None:
            raise ValueError(f"layer {module.layer_idx}: attention with {name}={kwargs[name]!r} is not supported")
    head_dim = query.shape[-1]
    if scaling is not None and not math.isclose(scaling * math.sqrt(head_dim), 1.0, rel_tol=1e-9):
        # Our contexts use 1/sqrt(D); softmax(q k^T * scaling) == softmax((q * scaling sqrt(D)) k^T / sqrt(D)).
        query = query * (scaling * math.sqrt(head_dim))
    out = attn.attend(module.layer_idx, query, key, value)  # (B, Hq, T, D)
    return out.transpose(1, 2), None


def _register_attention() -> None:
    transformers = _transformers()
    transformers.AttentionInterface.register(ATTN_IMPLEMENTATION, _meshrl_attention)


# --------------------------------------------------------------------------------------------
# The wrapper
# --------------------------------------------------------------------------------------------


class HFCausalLM(nn.Module):
    """A transformers causal LM behind our model contract. Build on meta, then `to_empty()` and
    `init_weights()` or a load (models/hf.py); or build on a real device (HF initialises it).

    The HF model is `self.hf` (so our state-dict keys are HF's with the prefix "hf."); `layers` is
    a ModuleDict view over `self.hf.model.layers`, made on access and never registered.
    """

    def __init__(self, args: GenericArgs) -> None:
        super().__init__()
        transformers = _transformers()
        hf_config = _hf_config(args)
        check_hf_config(hf_config)
        _register_attention()
        self.args = args
        self.hf = transformers.AutoModelForCausalLM.from_config(hf_config, attn_implementation=ATTN_IMPLEMENTATION)
        self._check_structure()
        # logits = lm_head(h) * s for a known scalar s: hidden() returns h * s instead.
        self._hidden_scale = 1.0
        if hf_config.model_type in _LOGIT_SCALES:
            attr, inverse = _LOGIT_SCALES[hf_config.model_type]
            value = float(getattr(hf_config, attr, None) or 1.0)
            self._hidden_scale = 1.0 / value if inverse else value
        buffers = dict(self.hf.named_non_persistent_buffers())
        # Dtypes the architecture creates its derived buffers in (RoPE: fp32), kept across casts.
        self._buffer_dtypes = {name: b.dtype for name, b in buffers.items()}
        # CPU copies of their values, taken once they are real (at once when built off meta).
        self._buffer_values: dict[str, Tensor] | None = None
        if not any(b.is_meta for b in buffers.values()):
            self._buffer_values = self._snapshot_buffers()

    def _check_structure(self) -> None:
        name = type(self.hf).__name__
        base = getattr(self.hf, "model", None)
        layers = getattr(base, "layers", None)
        if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
            raise ValueError(f"{name} has no `model.layers` list of decoder layers; the generic path serves "
                             "decoder-only models laid out like Llama")
        for i, layer in enumerate(layers):
            attn = getattr(layer, "self_attn", None)
            if attn is None or getattr(attn, "layer_idx", None) != i:
                raise ValueError(f"{name}: decoder layer {i} has no `self_attn` with layer_idx={i}")
            if getattr(attn, "is_causal", True) is False:
                raise ValueError(f"{name}: layer {i} attention is not causal")
            if (getattr(attn, "attention_dropout", 0.0) or 0.0) > 0:
                raise ValueError(f"{name}: layer {i} has attention dropout {attn.attention_dropout}; {_NO_DROPOUT}")
            if getattr(attn, "sliding_window", None) is not None:
                raise ValueError(f"{name}: layer {i} uses sliding-window attention, which is not supported")
        for module_name, module in self.hf.named_modules():
            if isinstance(module, nn.Dropout) and module.p > 0:
                raise ValueError(f"{name}: {module_name} has dropout p={module.p}; {_NO_DROPOUT}")
        head = self.hf.get_output_embeddings()
        if not isinstance(head, nn.Linear) or head.bias is not None:
            raise ValueError(f"{name}: the LM head must be a bias-free nn.Linear, got {head!r}")

    # -- the contract -----------------------------------------------------------------------

    @property
    def layers(self) -> nn.ModuleDict:
        """The decoder layers keyed "0".."n-1": the HF modules themselves, for per-block sharding."""
        return nn.ModuleDict({str(i): layer for i, layer in enumerate(self.hf.model.layers)})

    @property
    def output_weight(self) -> Tensor:
        """The LM head matrix (V, dim); the embedding itself when the config ties them."""
        return self.hf.get_output_embeddings().weight

    def hidden(self, tokens: Tensor, positions: Tensor, attn: AttentionContext | None = None) -> Tensor:
        """tokens, positions (B, T) int64 -> final-normed hidden states (B, T, dim).

        `positions` become HF's position_ids (each packed document restarts at 0); `attn` decides
        the attention pattern, plain causal over the row when None. A known logit scale of the
        architecture is folded in, so logits are always F.linear(hidden, output_weight).
        """
        assert tokens.shape == positions.shape, f"tokens {tuple(tokens.shape)} vs positions {tuple(positions.shape)}"
        attn = CausalAttention() if attn is None else attn
        if self.hf.config._attn_implementation != ATTN_IMPLEMENTATION:
            # e.g. another model was built with from_config(wrapper.hf.config, attn_implementation=...),
            # which rewrites the shared config object: attention would silently bypass `attn`.
            raise ValueError(f"the wrapped model's attention implementation was changed to "
                             f"{self.hf.config._attn_implementation!r}; it must stay {ATTN_IMPLEMENTATION!r}")
        out = self.hf.model(input_ids=tokens, position_ids=positions, use_cache=False, **{_ATTN_KWARG: attn})
        h = out.last_hidden_state  # (B, T, dim)
        return h if self._hidden_scale == 1.0 else h * self._hidden_scale

    def forward(self, tokens: Tensor, positions: Tensor, attn: AttentionContext | None = None,
                head: OutputHead | None = None) -> Any:
        """tokens, positions (B, T) int64 -> logits (B, T, vocab_size), or head(hidden, output_weight)."""
        h = self.hidden(tokens, positions, attn)
        return F.linear(h, self.output_weight) if head is None else head(h, self.output_weight)

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """Initialise every parameter in place with transformers' scheme for this architecture.

        Scheme: the architecture's own `_init_weights` (typically Linear/Embedding ~ N(0,
        initializer_range), biases 0, norm weights 1, model-specific exceptions), then the LM head
        re-tied if the config ties it. With `seed`, the draws come from a forked RNG seeded with it
        (the global RNG state is restored afterwards); without it the global RNG is used.
        """
        device = next(self.parameters()).device
        _clear_init_flags(self.hf)
        with _seeded(seed, device):
            self.hf.initialize_weights()
        _clear_init_flags(self.hf)
        self.hf.tie_weights()
        self._restore_buffers()

    # -- derived state across to_empty / to / cuda --------------------------------------------

    def _apply(self, fn, recurse: bool = True):
        # Every device/dtype move (to, to_empty, cuda, float, ...) goes through here. Leaving the
        # meta device creates a fresh Parameter per module, which unties a tied LM head, and
        # leaves non-persistent buffers uninitialised; a dtype cast would round RoPE frequencies.
        super()._apply(fn, recurse)
        self.hf.tie_weights()
        self._restore_buffers()
        return self

    def _snapshot_buffers(self) -> dict[str, Tensor]:
        return {name: b.detach().to("cpu", copy=True) for name, b in self.hf.named_non_persistent_buffers()}

    def _restore_buffers(self) -> None:
        buffers = dict(self.hf.named_non_persistent_buffers())
        if not buffers or any(b.is_meta for b in buffers.values()):
            return
        for name, buf in buffers.items():
            owner, leaf = self._owner(name)
            if self._buffer_values is None:
                owner._buffers[leaf] = torch.empty(buf.shape, dtype=self._buffer_dtypes[name], device=buf.device)
            else:
                owner._buffers[leaf] = self._buffer_values[name].to(buf.device)
        if self._buffer_values is None:
            # First time off the meta device: let transformers compute the buffers, with every
            # parameter and persistent buffer marked done so that its init skips them.
            done = list(self.hf.parameters())
            done += [b for name, b in self.hf.named_buffers() if name not in buffers]
            _compute_buffers(self.hf, done)
            self._buffer_values = self._snapshot_buffers()

    def _owner(self, name: str) -> tuple[nn.Module, str]:
        parent, _, leaf = name.rpartition(".")
        return self.hf.get_submodule(parent), leaf


def _clear_init_flags(model: nn.Module) -> None:
    """Drop transformers' "already initialised" marks, which would make a later init skip modules."""
    for module in model.modules():
        module.__dict__.pop("_is_hf_initialized", None)


def _compute_buffers(model: nn.Module, done: list[Tensor]) -> None:
    """Run transformers' init with `done` tensors marked initialised: only the rest is written."""
    for t in done:
        t._is_hf_initialized = True
    _clear_init_flags(model)
    try:
        model.initialize_weights()
    finally:  # the marks must not outlive this call (a later init_weights would skip these tensors)
        for t in done:
            del t._is_hf_initialized
        _clear_init_flags(model)


@contextmanager
def _seeded(seed: int | None, device: torch.device) -> Iterator[None]:
    """Seed the RNG of `device` (and the CPU) inside, restoring both afterwards; no-op for None."""
    if seed is None:
        yield
        return
    cuda = device.type == "cuda"
    with torch.random.fork_rng(devices=[device] if cuda else []):
        torch.default_generator.manual_seed(seed)
        if cuda:
            with torch.cuda.device(device):
                torch.cuda.manual_seed(seed)  # this device only: seeding all would touch every GPU
        yield


# --------------------------------------------------------------------------------------------
# State-dict adapter, plan, family
# --------------------------------------------------------------------------------------------


class GenericStateDictAdapter:
    """Our keys are HF's with the prefix "hf."; the map is explicit and unknown keys raise.

    The valid keys and the tied pairs ({target: source}, e.g. lm_head.weight -> embed_tokens)
    come from a meta instance of the model. `to_hf` stores a tied target once (as its source);
    `from_hf` drops a stored tied copy and fills the target from its source. Checkpoint keys for
    RoPE inverse frequencies (old checkpoints) are ignored, as transformers does. Values pass
    through untouched (plain tensors, DTensors or gradients alike).
    """

    def __init__(self, args: GenericArgs) -> None:
        with torch.device("meta"):
            model = HFCausalLM(args)
        self.keys = {k.removeprefix(PREFIX) for k in model.state_dict()}
        self.tied: dict[str, str] = dict(model.hf.all_tied_weights_keys)

    def to_hf(self, state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
        out: dict[str, Tensor] = {}
        for key, value in state_dict.items():
            hf_key = key.removeprefix(PREFIX)
            if not key.startswith(PREFIX) or hf_key not in self.keys:
                raise ValueError(f"unknown state-dict key {key!r} for the generic HF model")
            if hf_key not in self.tied:
                out[hf_key] = value
        return out

    def from_hf(self, state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
        out: dict[str, Tensor] = {}
        for key, value in state_dict.items():
            if key.endswith("rotary_emb.inv_freq"):
                continue  # derived, recomputed from the config
            if key not in self.keys:
                raise ValueError(f"unknown HF state-dict key {key!r} for this model")
            if key in self.tied:
                continue  # a stored copy of a tied weight: the source is the weight
            out[PREFIX + key] = value
            for target, source in self.tied.items():
                if source == key:
                    out[PREFIX + target] = value
        return out


# FSDP2 wraps each decoder layer, then the root (embedding, final norm, LM head). No TP plan:
# the HF attention reshapes with the config's head counts, so column-sharded projections would break it.
PARALLEL_PLAN: dict[str, Any] = {"fsdp_units": ["hf.model.layers.*"], "tp": {}}

GENERIC_FAMILY = ModelFamily(
    name="hf",
    args_cls=GenericArgs,
    model_cls=HFCausalLM,
    flavors={},
    state_dict_adapter=GenericStateDictAdapter,
    parallel_plan=PARALLEL_PLAN,
)


def build_generic(config: dict[str, Any]) -> HFCausalLM:
    """The generic wrapper for an HF config dict, on the meta device (then `to_empty` + init or load)."""
    with torch.device("meta"):
        return HFCausalLM(GenericArgs.from_hf_config(config))
