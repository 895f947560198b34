"""The trainer's RL step with and without shared-prompt packing, at the trl_compare shape (CPU).

    OMP_NUM_THREADS=1 python benchmarks/shared_prompt.py [--rounds 5] [--attention split] [--flavor tiny]
    python benchmarks/shared_prompt.py --device cuda --flavor 0.6B --prompt-len 256 --gen-len 512 \
        --prompts 4 --samples 16 --seq-len 16384 --attention auto     # GPU: bf16 weights

One process, the plain `tiny` Qwen3 (vocab 100), `Trainer.rl_step` over one step's samples:
8 prompts of 35-45 tokens x 8 samples with 1-48 completion tokens (random, seed 0; `--prompt-len P`
gives prompts of 0.9P-1.1P tokens, `--gen-len G` completions of 1-G tokens), packed into
`--seq-len` rows with `trainer.share_prompts` off and on, the two interleaved for `--rounds` rounds
after one warm-up each. Prints one JSON line per setting: tokens per step, the median CPU and wall
seconds per step. Nothing is asserted; docs/benchmarks.md records runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import time

import torch

from meshrl.models import get_family
from meshrl.runtime.config import LossConfig, OptimConfig
from meshrl.runtime.train.packing import Sample, count_loss_tokens, pack
from meshrl.runtime.train.trainer import Trainer


def samples(prompts: int, per_prompt: int, vocab: int, seed: int = 0, prompt_len: int = 40,
            gen_len: int = 48) -> list[Sample]:
    rng = random.Random(seed)
    out = []
    for _ in range(prompts):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(int(0.9 * prompt_len), int(1.1 * prompt_len)))]
        for _ in range(per_prompt):
            n = rng.randint(1, gen_len)
            out.append(Sample(prompt, [rng.randrange(3, vocab) for _ in range(n)],
                              [rng.uniform(-5, -0.1) for _ in range(n)], advantage=rng.uniform(-1, 1)))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--attention", default="split")
    p.add_argument("--flavor", default="tiny")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=40)
    p.add_argument("--gen-len", type=int, default=48)
    p.add_argument("--device", default="cpu")
    opts = p.parse_args()
    fam = get_family("qwen3")
    device = torch.device(opts.device)
    args = dataclasses.replace(fam.flavors[opts.flavor], vocab_size=100 if opts.flavor == "tiny" else 151936)
    with torch.device("meta"):
        model = fam.model_cls(args)
    model.to_empty(device=device)
    model.init_weights(seed=0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model.to(dtype)
    trainer = Trainer(model, OptimConfig(lr=1e-6), device, None, attention=opts.attention, compute_dtype=dtype)
    data = samples(opts.prompts, opts.samples, args.vocab_size, prompt_len=opts.prompt_len, gen_len=opts.gen_len)
    settings = {share: pack(data, opts.seq_len, 1, share_prompts=share)[0] for share in (False, True)}
    times: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
    for r in range(opts.rounds + 1):
        for share, rows in settings.items():
            cpu, wall = time.process_time(), time.perf_counter()
            trainer.rl_step(rows, count_loss_tokens([rows]), LossConfig(), temperature=1.0)
            if device.type == "cuda":
                torch.cuda.synchronize()
            if r:  # round 0 warms up
                times[share].append((time.process_time() - cpu, time.perf_counter() - wall))
    for share, rows in settings.items():
        print(json.dumps({"share_prompts": share, "attention": trainer.attention, "rows": len(rows),
                          "tokens": sum(int(mb["input_ids"].shape[1]) for mb in rows),
                          "cpu_s": round(statistics.median(t[0] for t in times[share]), 4),
                          "wall_s": round(statistics.median(t[1] for t in times[share]), 4),
                          "threads": torch.get_num_threads()}))


if __name__ == "__main__":
    main()
