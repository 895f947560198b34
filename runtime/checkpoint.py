"""Checkpoints of the policy. Today: the HF-format export of the trainer's weights.

`export_hf` gathers each parameter's full tensor (a collective: every trainer rank calls
it) and the leader writes an HF folder (config.json, model.safetensors, tokenizer) that
transformers and our engine load. The folder appears atomically (written beside, renamed).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from torch import nn

from meshrl.models.hf import save_hf_model
from meshrl.parallel import full_tensors
from meshrl.runtime.rundir import log
from meshrl.runtime.tokenizer import save_tokenizer


def export_hf(model: nn.Module, args, tokenizer, path: Path, leader: bool) -> Path:
    """Write the full fp32 policy to `path` as an HF folder (leader only; all trainer ranks call)."""
    state = {name: t.detach().to("cpu", torch.float32) for name, t in full_tensors(model)}
    if leader:
        with tempfile.TemporaryDirectory() as tok_dir:
            save_tokenizer(tokenizer, tok_dir)
            save_hf_model(state, args, path, tokenizer_dir=tok_dir, bos_token_id=tokenizer.bos_token_id,
                          eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        log.info("saved the policy to %s", path)
    return path
