"""meshrl vs TRL on the same RL task, in the same run (CPU): reverse-text GRPO.

    python benchmarks/trl_compare.py [--repeats 2] [--steps 20] [--out FILE.jsonl]
                                     [--meshrl-arg=--trainer.micro-batch-tokens=256 ...]
                                     [--variant=--trainer.overlap-rollout=false ...]

Both frameworks start from the same weights (a fresh `tiny` char-level Qwen3, 0.8M parameters,
saved once as an HF folder with its tokenizer), see the same prompts in the same order
(reverse-text examples 0, 1, 2, ... of seed 0 with 3-6 words of 3-6 letters, the setup of
issue 18), and run the same schedule: 8 prompts x 8 samples per step, 48 new tokens at
temperature 1, 20 on-policy optimizer steps at a constant lr 1e-4 (AdamW, gradient clip 1.0).

- TRL: `GRPOTrainer` (1.16) on CPU with transformers `generate`; gradient checkpointing off (the
  model is tiny: recomputation would only slow it), one GRPO iteration per generation (on-policy),
  no shuffling (the same prompt order), the LCS reward of envs/reverse_text.py.
- meshrl: `meshrl rl` with its defaults (controller + trainer + native engine as one torchrun job of
  three processes), `max_off_policy_steps = 0` (on-policy), overrides only for the task above.

Each run is a fresh process; runs alternate (TRL, meshrl, [each --variant,] TRL, meshrl, ...) so that the shared
machine's load hits both alike. Printed per run (one JSON line): `rl_s` = the RL phase (TRL:
`trainer.train()`; meshrl: the sum of its steps' `time/step_s`), `samples_per_s` = steps x 64 /
rl_s, `wall_s` = the whole process (imports, start-up, model load), the reward of the first and last
steps, and for meshrl the trainer's seconds (`train_s`; `train_tail_s`: those after each step's last
rollout, all of them without `trainer.overlap_rollout`), the mean TRAIN messages per step
(`train_parts_mean`: 1 = nothing overlapped) and the mean fraction of the unshared packing's tokens
that shared-prompt packing saved (`prompt_shared_fraction`). Then a summary line:
the median rl_s of each framework and meshrl's samples/s over TRL's.
Nothing is asserted; docs/benchmarks.md records runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENV = {"seed": 0, "min_words": 3, "max_words": 6, "min_word_len": 3, "max_word_len": 6}


def make_start(folder: Path) -> None:
    """The shared starting point: a fresh tiny Qwen3 with the char tokenizer, as an HF folder."""
    import dataclasses

    import torch

    from meshrl.models import get_family
    from meshrl.models.hf import save_hf_model
    from meshrl.runtime.tokenizer import build_char_tokenizer, save_tokenizer

    tok = build_char_tokenizer()
    fam = get_family("qwen3")
    args = dataclasses.replace(fam.flavors["tiny"], vocab_size=len(tok))
    with torch.device("meta"):
        model = fam.model_cls(args)
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    save_hf_model(model, args, folder, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                  pad_token_id=tok.pad_token_id)
    save_tokenizer(tok, folder)


def run_trl(start: Path, steps: int, prompts: int, samples: int, max_tokens: int, lr: float, out: Path) -> dict:
    """One TRL GRPO run in this process -> its measurements."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from meshrl.envs.reverse_text import ReverseTextEnv

    env = ReverseTextEnv(**ENV)
    examples = [env.example(i) for i in range(steps * prompts)]
    data = Dataset.from_list([{"prompt": e.prompt, "index": e.index} for e in examples])

    def reward(completions, index, **_):
        return [env.score(examples[i], c).components["lcs"] for c, i in zip(completions, index)]

    cfg = GRPOConfig(output_dir=str(out), per_device_train_batch_size=prompts * samples, num_generations=samples,
                     max_completion_length=max_tokens, learning_rate=lr, lr_scheduler_type="constant", max_steps=steps,
                     num_iterations=1, temperature=1.0, top_p=1.0, shuffle_dataset=False,
                     gradient_checkpointing=False, logging_steps=1, report_to="none", save_strategy="no",
                     use_cpu=True, bf16=False, seed=0, disable_tqdm=True)
    model = AutoModelForCausalLM.from_pretrained(start, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(start)
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=cfg, train_dataset=data, processing_class=tokenizer)
    begin = time.perf_counter()
    trainer.train()
    rl_s = time.perf_counter() - begin
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    return {"rl_s": rl_s, "reward_first": rewards[0], "reward_last": rewards[-1], "threads": torch.get_num_threads()}


def run_meshrl(start: Path, steps: int, prompts: int, samples: int, max_tokens: int, lr: float, out: Path,
               extra: list[str]) -> dict:
    """One `meshrl rl` job -> its measurements (read from its metrics.jsonl)."""
    env_flags = [x for k, v in ENV.items() for x in (f"--env.{k.replace('_', '-')}", str(v))]
    cmd = [sys.executable, "-m", "meshrl.runtime.cli", "rl", "--model.path", str(start), "--env.name", "reverse-text",
           *env_flags, "--prompts-per-step", str(prompts), "--samples-per-prompt", str(samples),
           "--inference.sampling.max-tokens", str(max_tokens), "--max-steps", str(steps),
           "--trainer.optim.lr", str(lr), "--max-off-policy-steps", "0", "--output-dir", str(out),
           "--log.console", "false", *extra]
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {"rl_s": sum(r["time/step_s"] for r in rows), "reward_first": rows[0]["reward/mean"],
            "reward_last": rows[-1]["reward/mean"], "train_s": sum(r["time/train_s"] for r in rows),
            "train_tail_s": sum(r.get("time/train_tail_s", r["time/train_s"]) for r in rows),
            "train_parts_mean": statistics.mean(r.get("batch/train_parts", 1) for r in rows),
            "prompt_shared_fraction": statistics.mean(r.get("tokens/prompt_shared_fraction", 0.0) for r in rows),
            "flags": extra}


def _child(opts: argparse.Namespace) -> None:
    """One run of one framework (a fresh process each, so imports and caches start cold alike)."""
    start = time.perf_counter()
    common = (Path(opts.start), opts.steps, opts.prompts, opts.samples, opts.max_tokens, opts.lr, Path(opts.run_dir))
    if opts.child == "trl":
        result = run_trl(*common)
    else:
        result = run_meshrl(*common, opts.meshrl_arg)
    result.update(framework=opts.child, samples_per_s=opts.steps * opts.prompts * opts.samples / result["rl_s"],
                  wall_s=time.perf_counter() - start)
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in result.items()}), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--dir", default="/tmp/meshrl-trl-compare")
    p.add_argument("--out", default=None, help="append the JSON lines to this file")
    p.add_argument("--only", choices=["trl", "meshrl"], default=None)
    p.add_argument("--meshrl-arg", action="append", default=[], help="an extra `meshrl rl` flag (repeatable)")
    p.add_argument("--variant", action="append", default=[],
                   help="one more meshrl run per repeat, with these space-separated extra flags (repeatable), "
                        "e.g. --variant=--trainer.share-prompts=false")
    p.add_argument("--child", choices=["trl", "meshrl"], default=None, help=argparse.SUPPRESS)
    p.add_argument("--start", default=None, help=argparse.SUPPRESS)
    p.add_argument("--run-dir", default=None, help=argparse.SUPPRESS)
    opts = p.parse_args()
    if opts.child:
        _child(opts)
        return
    root = Path(opts.dir)
    start = root / "start"
    if not (start / "config.json").is_file():
        make_start(start)
    frameworks = [opts.only] if opts.only else ["trl", "meshrl"]
    frameworks += [f"meshrl {v}" for v in opts.variant]
    results: dict[str, list[dict]] = {f: [] for f in frameworks}
    for r in range(opts.repeats):
        for fw in frameworks:
            child, *flags = fw.split()
            run_dir = root / f"{child}-{r}-{int(time.time())}"
            cmd = [sys.executable, __file__, "--child", child, "--start", str(start), "--run-dir", str(run_dir),
                   "--steps", str(opts.steps), "--prompts", str(opts.prompts), "--samples", str(opts.samples),
                   "--max-tokens", str(opts.max_tokens), "--lr", str(opts.lr),
                   *[f"--meshrl-arg={a}" for a in opts.meshrl_arg + flags]]
            proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT,
                                  env=dict(os.environ, TOKENIZERS_PARALLELISM="false"))
            if proc.returncode != 0:
                raise SystemExit(f"the {fw} run failed (exit {proc.returncode}); see {run_dir}/logs:\n"
                                 f"{proc.stderr[-3000:]}")
            row = json.loads(proc.stdout.splitlines()[-1])
            row["repeat"] = r
            results[fw].append(row)
            _emit(row, opts.out)
    summary = {f"{fw}_rl_s_median": statistics.median(x["rl_s"] for x in rows) for fw, rows in results.items()}
    if "trl" in results and "meshrl" in results:
        summary["meshrl_samples_per_s_over_trl"] = summary["trl_rl_s_median"] / summary["meshrl_rl_s_median"]
    summary["load_average"] = os.getloadavg()[0]
    _emit({k: round(v, 3) for k, v in summary.items()}, opts.out)


def _emit(row: dict, out: str | None) -> None:
    line = json.dumps(row)
    print(line, flush=True)
    if out:
        with open(out, "a") as f:
            f.write(line + "\n")


if __name__ == "__main__":
    main()
