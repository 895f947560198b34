"""Write the sft_chat example's files: a chat JSONL, a prompt JSONL and a tiny model folder.

    python examples/sft_chat/make_data.py --out runs/sft_chat/data

- ``chat.jsonl``: chats of one or two turns about small sums, e.g.
  user "3+4=" -> assistant "7", then user "+5" -> assistant "12" (train on the assistant turns);
- ``prompts.jsonl``: single-turn prompts {"prompt": "3+4=", "answer": "7"} of other sums, for RL
  with the `dataset` environment's math reward;
- ``model/``: a fresh Qwen3 of the "tiny" flavor (0.8M parameters) with a byte-level BPE tokenizer
  learnt from the chats (runtime/tokenizer.py's build_bpe_tokenizer: ChatML template, two stop
  ids), saved as an HF folder, as a user's checkpoint would be.

Everything is seeded: the same command writes the same files.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import tempfile
from pathlib import Path

import torch

from meshrl.envs.base import stop_token_ids
from meshrl.models import get_family
from meshrl.models.hf import save_hf_model
from meshrl.runtime.tokenizer import build_bpe_tokenizer, save_tokenizer


def chat(rng: random.Random) -> dict:
    a, b = rng.randint(0, 9), rng.randint(0, 9)
    messages = [{"role": "user", "content": f"{a}+{b}="}, {"role": "assistant", "content": str(a + b)}]
    if rng.random() < 0.5:
        c = rng.randint(0, 9)
        messages += [{"role": "user", "content": f"+{c}"}, {"role": "assistant", "content": str(a + b + c)}]
    return {"messages": messages}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--num-chats", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    opts = parser.parse_args()
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(opts.seed)
    chats = [chat(rng) for _ in range(opts.num_chats)]
    with open(out / "chat.jsonl", "w") as f:
        for row in chats:
            f.write(json.dumps(row) + "\n")
    with open(out / "prompts.jsonl", "w") as f:
        for a in range(10):
            for b in range(10):
                f.write(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n")
    corpus = [m["content"] for row in chats for m in row["messages"]]
    tokenizer = build_bpe_tokenizer(corpus + ["user assistant system"], vocab_size=300)
    family = get_family("qwen3")
    args = dataclasses.replace(family.flavors["tiny"], vocab_size=len(tokenizer))
    with torch.device("meta"):
        model = family.model_cls(args)
    model.to_empty(device="cpu")
    model.init_weights(seed=opts.seed)
    with tempfile.TemporaryDirectory() as tok_dir:
        save_tokenizer(tokenizer, tok_dir)
        save_hf_model(model, args, out / "model", tokenizer_dir=tok_dir, eos_token_id=list(stop_token_ids(tokenizer)),
                      pad_token_id=tokenizer.pad_token_id)
    print(f"wrote {out}: {len(chats)} chats, 100 prompts, a {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M "
          f"parameter model with a {len(tokenizer)}-token BPE vocabulary")


if __name__ == "__main__":
    main()
