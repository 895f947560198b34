"""Random models for engine tests."""

from __future__ import annotations

import torch
from torch import nn


def scaled_random_model(cls: type[nn.Module], args, seed: int = 0, scale: float = 8.0) -> nn.Module:
    """cls(args) built on meta, init_weights(seed) in fp32 on the CPU, weight matrices scaled up
    `scale` times: at std 0.02 a tiny model just echoes its last token, which would make greedy
    parity tests vacuous."""
    with torch.device("meta"):
        model = cls(args)
    model.to_empty(device="cpu")
    model.init_weights(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(scale)
    return model
