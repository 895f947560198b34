"""The SFT rank program: `torchrun --nproc-per-node N -m meshrl.runtime.sft @ cfg.toml`.

Supervised warm-up on an environment's reference completions, on the same trainer stack
as RL (FSDP2 over all ranks, packed rows, the same Trainer). There is no controller: every
rank derives the same packed batch from the dataset cursor (examples are a pure function of
the index) and trains on its own share. With `eval_every`, rank 0 greedily decodes held-out
prompts with the native engine and logs eval/reward, so the warm start's quality is known
before RL begins. The final weights are exported as an HF folder to checkpoints/final.
"""

from __future__ import annotations

import datetime
import os
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from meshrl.envs import make_env
from meshrl.parallel import full_tensors, parallelize
from meshrl.parallel.dims import build_meshes
from meshrl.runtime import launch as launching
from meshrl.runtime import checkpoint as ckpt
from meshrl.runtime.checkpoint import export_hf
from meshrl.runtime.config import SFTConfig
from meshrl.runtime.engine import NativeEngine, Request, SamplingParams, generate
from meshrl.runtime.layout import init_world, pick_device, use_cuda
from meshrl.runtime.packing import count_loss_tokens, pack_sft
from meshrl.runtime.policy import build_policy, build_trainer_policy, check_model_source, compute_dtype, load_tokenizer_for
from meshrl.runtime.rundir import MetricsWriter, ProgressLine, log, record_restart, restart_count, setup_logging, write_config
from meshrl.runtime.trainer import Trainer

MODULE = "meshrl.runtime.sft"
EVAL_OFFSET = 10**9  # held-out examples come from far past any training cursor


def preflight(cfg: SFTConfig) -> None:
    check_model_source(cfg.model)
    launching.check_world_size(cfg)
    if "WORLD_SIZE" not in os.environ:  # the launcher; under torchrun, rank 0 decides (decide_resume)
        ckpt.check_resume(cfg, "sft")


def launch(cfg: SFTConfig) -> int:
    """Run `cfg` as a torchrun job on this node; returns the exit code. Raises ValueError early."""
    preflight(cfg)
    return launching.launch(cfg, MODULE)


def main(argv: list[str] | None = None) -> None:
    launching.rank_main(SFTConfig, sys.argv[1:] if argv is None else argv, preflight, "trainer", run_rank)


def run_rank(cfg: SFTConfig, run_dir: Path) -> None:
    cuda = use_cuda(cfg.dist.device)
    device = pick_device(cuda)
    rank, world = init_world(cuda, cfg.dist.timeout_s)
    setup_logging(run_dir, rank, "trainer")
    # checkpoint collectives run in a background thread: a gloo group of their own
    ckpt_group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=cfg.dist.timeout_s))
    start = ckpt.decide_resume(cfg, "sft")
    run_sft(cfg, rank, world, device, start, ckpt_group)
    dist.destroy_process_group()


def run_sft(cfg: SFTConfig, rank: int, world: int, device: torch.device, start: int | None = None,
            ckpt_group=None) -> None:
    """`start`: the checkpoint step to resume from (None: fresh)."""
    run_dir = Path(cfg.output_dir)
    leader = rank == 0
    tokenizer = load_tokenizer_for(cfg.model)
    env = make_env(cfg.env.name, **cfg.env.kwargs())
    dims = cfg.trainer.parallel.dims(world)
    meshes = build_meshes(dims, list(range(world)), rank, device.type)
    p = cfg.trainer.parallel
    model, args = build_trainer_policy(
        cfg.model, device, lambda m: parallelize(m, meshes, compute_dtype(cfg.model, device), p.activation_checkpointing,
                                                 p.ac_every, p.compile), tokenizer)
    trainer = Trainer(model, cfg.trainer.optim, device, dist.group.WORLD, meshes, cfg.trainer.attention,
                      cfg.trainer.logprob_chunk_tokens, cfg.trainer.moe_aux_loss_coef,
                      compute_dtype(cfg.model, device))
    checkpointer = ckpt.TrainerCheckpointer(trainer, meshes, ckpt_group, leader, cfg.checkpoint,
                                           ckpt.manifest_base(cfg, "sft", dims, world))
    cursor = 0  # index of the first example of step `start or 0`
    if start is not None:
        path = ckpt.step_path(ckpt.checkpoints_dir(run_dir), start)
        checkpointer.load(path, ckpt.read_manifest(path))
        cursor = ckpt.read_state(run_dir, start, ckpt.RUN_FILE)["cursor"]
    metrics = None
    if leader:
        from meshrl.runtime.wandb_logger import make_sinks

        metrics = MetricsWriter(run_dir, start or 0, make_sinks(cfg.wandb, run_dir, cfg.model_dump(), start is not None))
        if start is not None or restart_count():
            record_restart(run_dir, start, metrics.steps_lost)
    progress = ProgressLine(cfg.max_steps, leader, "sft")
    if leader:
        write_config(run_dir, cfg.model_dump_json(indent=2))
    evaluator = Evaluator(cfg, env, tokenizer, device) if cfg.eval_every else None
    eos = tokenizer.eos_token_id
    for step in range(start or 0, cfg.max_steps):
        examples = []
        for index in range(cursor, cursor + cfg.batch_size):
            ex = env.example(index)
            prompt = tokenizer.encode(ex.prompt, add_special_tokens=False)
            completion = tokenizer.encode(env.sft_completion(ex), add_special_tokens=False) + [eos]
            examples.append((prompt, completion))
        batches = pack_sft(examples, cfg.trainer.micro_batch_tokens, dims.num_data_ranks,
                           pad_id=tokenizer.pad_token_id or 0)
        stats = trainer.sft_step(batches[dims.data_rank(rank)], count_loss_tokens(batches))
        row = {"step": step, "loss": stats["loss"], "grad_norm": stats["grad_norm"], "lr": stats["lr"],
               "tokens/train": stats["train_tokens"], "time/train_s": stats["train_time_s"],
               "tokens/train_per_s": stats["train_tokens"] / max(stats["train_time_s"], 1e-9),
               **{k: v for k, v in stats.items() if k.startswith("moe/")}}
        if evaluator is not None and ((step + 1) % cfg.eval_every == 0 or step + 1 == cfg.max_steps):
            row["eval/reward"] = evaluator.run(model, leader)
        if leader:
            metrics.write(row)
            status = f"loss {stats['loss']:.3f}" + (f"  eval/reward {row['eval/reward']:.3f}" if "eval/reward" in row else "")
            progress.update(step + 1, status)
            log.info("step %d: %s", step, row)
        cursor += cfg.batch_size
        n, c = step + 1, cfg.checkpoint
        if c.every and (n % c.every == 0 or n == cfg.max_steps):
            checkpointer.save_with(n, ckpt.checkpoints_dir(run_dir), {ckpt.RUN_FILE: {"step": n, "cursor": cursor}})
        if c.export_every and n % c.export_every == 0 and n < cfg.max_steps:
            export_hf(model, args, tokenizer, ckpt.checkpoints_dir(run_dir) / f"hf_step_{n}", leader)
    progress.close()
    checkpointer.close()
    if metrics is not None:
        metrics.close()
    export_hf(model, args, tokenizer, run_dir / "checkpoints" / "final", leader)


class Evaluator:
    """Greedy decoding of held-out prompts on an unsharded copy of the model (rank 0)."""

    def __init__(self, cfg: SFTConfig, env, tokenizer, device: torch.device):
        self.cfg, self.env, self.tokenizer, self.device = cfg, env, tokenizer, device
        self.examples = [env.example(EVAL_OFFSET + i) for i in range(cfg.eval_examples)]
        self.copy = None

    def run(self, model, leader: bool) -> float:
        """Mean reward of greedy completions (collective: every rank gathers the weights)."""
        state = {name: t.detach().clone() for name, t in full_tensors(model)}
        if not leader:
            return float("nan")
        if self.copy is None:
            self.copy, _ = build_policy(self.cfg.model, self.device, torch.float32, tokenizer=self.tokenizer)
        self.copy.load_state_dict(state, strict=True)
        tok = self.tokenizer
        prompts = [tok.encode(ex.prompt, add_special_tokens=False) for ex in self.examples]
        max_len = max(len(p) for p in prompts) + self.cfg.max_tokens + 1
        engine = NativeEngine(self.copy, max_num_seqs=len(prompts), max_model_len=max_len, device=self.device,
                              dtype=compute_dtype(self.cfg.model, self.device))
        sampling = SamplingParams(temperature=0.0, max_tokens=self.cfg.max_tokens, stop_token_ids=(tok.eos_token_id,))
        done = generate(engine, [Request(i, p, sampling) for i, p in enumerate(prompts)])
        rewards = []
        for ex, c in zip(self.examples, done):
            ids = [t for t in c.token_ids if t != tok.eos_token_id]
            rewards.append(float(self.env.score(ex, tok.decode(ids))))
        return statistics.fmean(rewards)


if __name__ == "__main__":
    main()
