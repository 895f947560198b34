"""The initialiser every native family shares, driven by the family's rule table.

A family states its scheme as `(pattern, init)` rules over parameter names, e.g.

    INIT_RULES = (
        ("*norm.weight", ONES),               # every RMSNorm
        ("*attention.wo.weight", RESIDUAL),   # residual output projections: depth-scaled
        ("*", NORMAL),                        # everything else: N(0, 0.02)
    )

`init_parameters` walks `model.named_parameters()` (module registration order, each module's
parameters in order) and gives every parameter the init of the first rule whose pattern
(`fnmatch`, where "*" also spans dots, so wrapper prefixes such as an activation-checkpoint
wrapper's do not matter) matches its name. A parameter that no rule matches fails an assert
rather than staying uninitialised. One generator draws all parameters in that order, so a seed fixes
the whole model, whatever device it is on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fnmatch import fnmatchcase

import torch
from torch import nn


@dataclass(frozen=True)
class Normal:
    """N(0, std); with `depth_scaled`, std / sqrt(2 * n_layers) (GPT-2): the residual stream adds
    two such outputs per block, so its variance then does not grow with depth."""

    std: float = 0.02
    depth_scaled: bool = False


@dataclass(frozen=True)
class Constant:
    """Every element = value (1 for norm weights)."""

    value: float


NORMAL = Normal(0.02)
RESIDUAL = Normal(0.02, depth_scaled=True)
ONES = Constant(1.0)

InitRules = tuple[tuple[str, Normal | Constant], ...]


@torch.no_grad()
def init_parameters(model: nn.Module, rules: InitRules, n_layers: int, device: torch.device,
                    seed: int | None = None) -> None:
    """Initialise every parameter of `model` in place by `rules` (see the module docstring).

    With `seed`, a private generator on `device` (the parameters' device) makes the result
    reproducible without touching the global RNG; without it the global RNG is used. On the meta
    device there is nothing to draw.
    """
    gen = None
    if seed is not None and device.type != "meta":
        gen = torch.Generator(device=device).manual_seed(seed)
    for name, param in model.named_parameters():
        init = next((init for pattern, init in rules if fnmatchcase(name, pattern)), None)
        assert init is not None, f"no init rule matches parameter {name!r} of {type(model).__name__}"
        if isinstance(init, Constant):
            nn.init.constant_(param, init.value)
        else:
            std = init.std / math.sqrt(2 * n_layers) if init.depth_scaled else init.std
            nn.init.normal_(param, mean=0.0, std=std, generator=gen)
