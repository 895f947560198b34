"""The RL rank program: `torchrun --nproc-per-node N -m meshrl.runtime.rl @ cfg.toml`.

Every rank runs `main`: validate the config, start the default group, agree on roles, build
the groups and meshes, then run its role: `Controller.run`, `run_trainer` or
`run_inference`. From Python, `launch(RLConfig(...))` starts the whole job under torchrun.
"""

from __future__ import annotations

import datetime
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from meshrl.envs import make_env
from meshrl.parallel import parallelize
from meshrl.runtime import launch as launching
from meshrl.runtime import transport, weight_sync
from meshrl.runtime import checkpoint as ckpt
from meshrl.runtime.checkpoint import export_hf
from meshrl.runtime.config import RLConfig
from meshrl.runtime.controller import Controller
from meshrl.runtime.inference import check_tensor_parallel_model, run_inference
from meshrl.runtime.layout import (CONTROLLER, TRAINER, Layout, assign_roles, build_layout, find_controller, init_world,
                                   pick_device, use_cuda)
from meshrl.runtime.policy import build_trainer_policy, check_model_source, compute_dtype, load_tokenizer_for
from meshrl.runtime.rundir import Heartbeat, MetricsWriter, log, record_restart, restart_count, setup_logging, write_config
from meshrl.runtime.trainer import Trainer
from meshrl.runtime.transport import Message

MODULE = "meshrl.runtime.rl"


def preflight(cfg: RLConfig) -> None:
    """Checks that need no process group: model folder, world size, devices."""
    check_model_source(cfg.model)
    check_tensor_parallel_model(cfg.inference, cfg.model)
    launching.check_world_size(cfg)
    if "WORLD_SIZE" not in os.environ:  # the launcher; under torchrun, rank 0 decides (decide_resume)
        ckpt.check_resume(cfg, "rl")
    if use_cuda(cfg.dist.device):
        gpus = cfg.layout.num_trainer_ranks + cfg.layout.num_inference_ranks
        if "WORLD_SIZE" not in os.environ and gpus > torch.cuda.device_count():
            raise ValueError(f"layout: {gpus} trainer + inference ranks need {gpus} GPUs, this node has "
                             f"{torch.cuda.device_count()}")


def launch(cfg: RLConfig) -> int:
    """Run `cfg` as a torchrun job on this node (the Python entry point); returns the exit code.

    Raises ValueError for a config that cannot run here (missing model folder, too few GPUs).
    """
    preflight(cfg)
    return launching.launch(cfg, MODULE)


def main(argv: list[str] | None = None) -> None:
    launching.rank_main(RLConfig, sys.argv[1:] if argv is None else argv, preflight, "starting", run_rank)


def run_rank(cfg: RLConfig, run_dir: Path) -> None:
    """Start the process group, agree on roles, build the layout, run this rank's role."""
    cuda = use_cuda(cfg.dist.device)
    device = pick_device(cuda)
    rank, world = init_world(cuda, cfg.dist.timeout_s)
    roles = assign_roles(world, cfg.layout.num_trainer_ranks, cfg.layout.num_inference_ranks, find_controller(device),
                         cfg.inference.tensor_parallel)
    role = roles.role_of(rank)
    setup_logging(run_dir, rank, role)
    layout = build_layout(roles, rank, device, cfg.dist.timeout_s, cfg.dist.message_timeout_s, cuda,
                          cfg.trainer.parallel.dims(cfg.layout.num_trainer_ranks))
    log.info("pid %d; roles: controller %d, trainers %s, inference %s; device %s", os.getpid(), roles.controller,
             roles.trainers, roles.inference, layout.device)
    # checkpoint collectives run in a background thread: a gloo group of their own (all ranks create it)
    ckpt_group = dist.new_group(list(roles.trainers), backend="gloo",
                                timeout=datetime.timedelta(seconds=cfg.dist.timeout_s))
    start = ckpt.decide_resume(cfg, "rl")
    # guarded again, now that the role is known: the error file names it
    launching.guarded(run_dir, rank, role, lambda: run_role(cfg, layout, run_dir, start, ckpt_group))
    dist.destroy_process_group()


def run_role(cfg: RLConfig, layout: Layout, run_dir: Path, start: int | None = None, ckpt_group=None) -> None:
    """`start`: the checkpoint step this run resumes from (None: a fresh run)."""
    if layout.role == CONTROLLER:
        from meshrl.runtime.wandb_logger import make_sinks

        write_config(run_dir, cfg.model_dump_json(indent=2))
        tokenizer = load_tokenizer_for(cfg.model)
        env = make_env(cfg.env.name, **cfg.env.kwargs())
        metrics = MetricsWriter(run_dir, start or 0, make_sinks(cfg.wandb, run_dir, cfg.model_dump(), start is not None))
        controller = Controller(cfg, layout, env, tokenizer, run_dir, metrics)
        if start is not None:
            controller.load_state_dict(ckpt.read_state(run_dir, start, ckpt.CONTROLLER_FILE))
        if start is not None or restart_count():
            record_restart(run_dir, start, metrics.steps_lost)
        final = controller.run()
        log.info("finished: %s", final)
    elif layout.role == TRAINER:
        run_trainer(cfg, layout, start, ckpt_group)
    else:
        run_inference(cfg, layout, start or 0)


def run_trainer(cfg: RLConfig, layout: Layout, start: int | None = None, ckpt_group=None) -> None:
    device = layout.device
    tokenizer = load_tokenizer_for(cfg.model)
    dtype = compute_dtype(cfg.model, device)  # of the forward pass and of the weights sent to inference
    p = cfg.trainer.parallel
    model, args = build_trainer_policy(
        cfg.model, device, lambda m: parallelize(m, layout.trainer_meshes, dtype, p.activation_checkpointing,
                                                 p.ac_every, p.compile), tokenizer)
    trainer = Trainer(model, cfg.trainer.optim, device, layout.trainer_group, layout.trainer_meshes,
                      cfg.trainer.attention, cfg.trainer.logprob_chunk_tokens, cfg.trainer.moe_aux_loss_coef, dtype)
    src = layout.roles.trainers[0]
    leader = layout.is_trainer_leader
    checkpointer = ckpt.TrainerCheckpointer(
        trainer, layout.trainer_meshes, ckpt_group, leader, cfg.checkpoint,
        ckpt.manifest_base(cfg, "rl", layout.trainer_meshes.dims, cfg.layout.num_trainer_ranks))
    if start is not None:  # before version `start` goes to the engines
        path = ckpt.step_path(ckpt.checkpoints_dir(cfg.output_dir), start)
        checkpointer.load(path, ckpt.read_manifest(path))
    beat = Heartbeat(cfg.log.heartbeat_s)

    def sync() -> float:
        start = time.perf_counter()
        weight_sync.send_weights(model, layout.sync_group if leader else None, src, dtype,
                                 cfg.weight_sync.bucket_mb, device)
        return time.perf_counter() - start

    sync()  # version 0, which also warms the sync group's communicator up
    controller = layout.roles.controller
    down, up = layout.down[layout.rank], layout.up[layout.rank]
    while True:
        beat.set(f"waiting for the controller after version {trainer.version}")
        msg = transport.recv(controller, down)
        checkpointer.poll()
        if msg.kind == "stop":
            beat.set("final checkpoint and export")
            checkpointer.close()
            export_hf(model, args, tokenizer, Path(cfg.output_dir) / "checkpoints" / "final", leader)
            if leader:
                transport.send(Message("done"), controller, up)
            beat.close()
            return
        if msg.kind == "checkpoint":
            beat.set(f"checkpoint step_{msg.meta['step']}")
            if "path" in msg.meta:
                checkpointer.save(msg.meta["step"], Path(msg.meta["path"]))
            if "export" in msg.meta:
                export_hf(model, args, tokenizer, Path(msg.meta["export"]), leader)
            continue
        assert msg.kind == "train", msg.kind
        beat.set(f"train step {msg.meta['step']}")
        mbs = [msg.data[str(i)] for i in range(msg.meta["num_micro_batches"])]
        stats = trainer.rl_step(mbs, msg.meta["num_loss_tokens"], cfg.trainer.loss, cfg.inference.sampling.temperature)
        if leader:  # before the broadcast: the controller must tell inference to join it
            transport.send(Message("weights", {"version": trainer.version}), controller, up)
        beat.set(f"weight sync v{trainer.version}")
        sync_s = sync()
        if leader:
            transport.send(Message("report", {"step": msg.meta["step"], "version": trainer.version, "stats": stats,
                                              "weight_sync_s": sync_s}), controller, up)


if __name__ == "__main__":
    main()
