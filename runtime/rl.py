"""The RL rank program: `torchrun --nproc-per-node N -m meshrl.runtime.rl @ cfg.toml`.

Every rank runs `main`: validate the config, start the default group, agree on roles, build
the groups and meshes, then run its role: `Controller.run`, `run_trainer` or
`run_inference`. From Python, `launch(RLConfig(...))` starts the whole job under torchrun.
"""

from __future__ import annotations

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
from meshrl.runtime.checkpoint import export_hf
from meshrl.runtime.config import RLConfig
from meshrl.runtime.controller import Controller
from meshrl.runtime.inference import run_inference
from meshrl.runtime.layout import (CONTROLLER, TRAINER, Layout, assign_roles, build_layout, find_controller, init_world,
                                   pick_device, use_cuda)
from meshrl.runtime.policy import build_trainer_policy, check_model_source, compute_dtype, load_tokenizer_for
from meshrl.runtime.rundir import log, setup_logging, write_config
from meshrl.runtime.trainer import Trainer
from meshrl.runtime.transport import Message

MODULE = "meshrl.runtime.rl"


def preflight(cfg: RLConfig) -> None:
    """Checks that need no process group: model folder, world size, devices."""
    check_model_source(cfg.model)
    launching.check_world_size(cfg)
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
    roles = assign_roles(world, cfg.layout.num_trainer_ranks, cfg.layout.num_inference_ranks, find_controller(device))
    role = roles.role_of(rank)
    setup_logging(run_dir, rank, role)
    layout = build_layout(roles, rank, device, cfg.dist.timeout_s, cfg.dist.message_timeout_s, cuda,
                          cfg.trainer.parallel.dims(cfg.layout.num_trainer_ranks))
    log.info("pid %d; roles: controller %d, trainers %s, inference %s; device %s", os.getpid(), roles.controller,
             roles.trainers, roles.inference, layout.device)
    # guarded again, now that the role is known: the error file names it
    launching.guarded(run_dir, rank, role, lambda: run_role(cfg, layout, run_dir))
    dist.destroy_process_group()


def run_role(cfg: RLConfig, layout: Layout, run_dir: Path) -> None:
    if layout.role == CONTROLLER:
        write_config(run_dir, cfg.model_dump_json(indent=2))
        tokenizer = load_tokenizer_for(cfg.model)
        env = make_env(cfg.env.name, **cfg.env.kwargs())
        final = Controller(cfg, layout, env, tokenizer, run_dir).run()
        log.info("finished: %s", final)
    elif layout.role == TRAINER:
        run_trainer(cfg, layout)
    else:
        run_inference(cfg, layout)


def run_trainer(cfg: RLConfig, layout: Layout) -> None:
    device = layout.device
    tokenizer = load_tokenizer_for(cfg.model)
    dtype = compute_dtype(cfg.model, device)  # of the forward pass and of the weights sent to inference
    p = cfg.trainer.parallel
    model, args = build_trainer_policy(
        cfg.model, device, lambda m: parallelize(m, layout.trainer_meshes, dtype, p.activation_checkpointing,
                                                 p.ac_every, p.compile), tokenizer)
    trainer = Trainer(model, cfg.trainer.optim, device, layout.trainer_group, layout.trainer_meshes,
                      cfg.trainer.attention, cfg.trainer.logprob_chunk_tokens, cfg.trainer.moe_aux_loss_coef)
    src = layout.roles.trainers[0]
    leader = layout.is_trainer_leader

    def sync() -> float:
        start = time.perf_counter()
        weight_sync.send_weights(model, layout.sync_group if leader else None, src, dtype,
                                 cfg.weight_sync.bucket_mb, device)
        return time.perf_counter() - start

    sync()  # version 0, which also warms the sync group's communicator up
    controller = layout.roles.controller
    down, up = layout.down[layout.rank], layout.up[layout.rank]
    while True:
        msg = transport.recv(controller, down)
        if msg.kind == "stop":
            export_hf(model, args, tokenizer, Path(cfg.output_dir) / "checkpoints" / "final", leader)
            if leader:
                transport.send(Message("done"), controller, up)
            return
        assert msg.kind == "train", msg.kind
        mbs = [msg.data[str(i)] for i in range(msg.meta["num_micro_batches"])]
        stats = trainer.rl_step(mbs, msg.meta["num_loss_tokens"], cfg.trainer.loss, cfg.inference.sampling.temperature)
        if leader:  # before the broadcast: the controller must tell inference to join it
            transport.send(Message("weights", {"version": trainer.version}), controller, up)
        sync_s = sync()
        if leader:
            transport.send(Message("report", {"step": msg.meta["step"], "version": trainer.version, "stats": stats,
                                              "weight_sync_s": sync_s}), controller, up)


if __name__ == "__main__":
    main()
