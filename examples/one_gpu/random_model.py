"""Write a randomly initialised Qwen3 of a real shape, with its real vocabulary, as an HF folder.

    python examples/one_gpu/random_model.py --flavor 0.6B --out runs/random-0.6B

The tokenizer is the char-level one (runtime/tokenizer.py) padded with unused `<extra_i>` tokens
up to the flavor's vocabulary (151,936 for Qwen3), so that the LM head, the sampler and the weight sync
move as many bytes as the real model's; a random policy's rollouts are noise, which is what a
speed benchmark wants (every completion runs to max_tokens). Weights are saved in bf16.
"""

from __future__ import annotations

import argparse
import tempfile

import torch

from meshrl.models import get_family
from meshrl.models.hf import save_hf_model
from meshrl.runtime.tokenizer import build_char_tokenizer, save_tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", default="qwen3")
    parser.add_argument("--flavor", default="0.6B")
    parser.add_argument("--out", required=True)
    parser.add_argument("--seed", type=int, default=0)
    opts = parser.parse_args()
    family = get_family(opts.family)
    args = family.flavors[opts.flavor]
    tokenizer = build_char_tokenizer(args.vocab_size)
    with torch.device("meta"):
        model = family.model_cls(args)
    model.to_empty(device="cuda" if torch.cuda.is_available() else "cpu")
    model.init_weights(seed=opts.seed)
    with tempfile.TemporaryDirectory() as tok_dir:
        save_tokenizer(tokenizer, tok_dir)
        save_hf_model(model, args, opts.out, tokenizer_dir=tok_dir, dtype=torch.bfloat16,
                      bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                      pad_token_id=tokenizer.pad_token_id)
    print(f"wrote {opts.out}: {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters, "
          f"vocabulary {len(tokenizer)}")


if __name__ == "__main__":
    main()
