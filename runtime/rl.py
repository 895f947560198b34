"""The RL rank program: `torchrun --nproc-per-node N -m meshrl.runtime.rl @ cfg.toml`.

Every rank runs `main`: validate the config, start the default group, agree on roles, build
the groups and meshes, then run its role's loop: the controller (runtime/rollout/controller.py),
a trainer rank (runtime/train/loop.py) or an inference rank (runtime/engine/loop.py); the
messages between them are runtime/protocol.py's. From Python, `launch(RLConfig(...))` starts
the whole job under torchrun.
"""

from __future__ import annotations

import datetime
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from meshrl.envs.dataset import check_dataset_envs
from meshrl.runtime import checkpoint as ckpt
from meshrl.runtime import launch as launching
from meshrl.runtime import memory
from meshrl.runtime.config import RLConfig
from meshrl.runtime.layout import (CONTROLLER, TRAINER, Layout, assign_roles, build_layout, find_controller, init_world,
                                   pick_device, resolve_colocation, use_cuda)
from meshrl.runtime.policy import check_model_source
from meshrl.runtime.rundir import log, setup_logging

# The roles' loops (engines, trainer, controller, environments, transformers, tensordict) are
# imported in run_role: the launcher's pre-flight checks need none of them.

MODULE = "meshrl.runtime.rl"
# what the ranks import beyond the launcher (tokenizer, tensordict, the roles' loops): imported by the
# launcher once when it forks the ranks (launch.rank_start), not by each rank
PRELOAD = ("transformers.tokenization_utils_tokenizers", "meshrl.runtime.rollout.controller",
           "meshrl.runtime.train.loop", "meshrl.runtime.engine.loop")


def preflight(cfg: RLConfig) -> None:
    """Checks that need no process group: model folder, world size, devices."""
    check_model_source(cfg.model, cfg.trainer.parallel.ep, cfg.trainer.parallel.cp)
    if cfg.inference.tensor_parallel > 1:
        from meshrl.runtime.engine.build import check_tensor_parallel_model

        check_tensor_parallel_model(cfg.inference, cfg.model)
    if cfg.inference.prefill_ranks:  # a model whose layers keep recurrent state cannot hand sequences off
        from meshrl.runtime.engine.build import check_disaggregated_model

        check_disaggregated_model(cfg.inference, cfg.model)
    launching.check_world_size(cfg)
    if "WORLD_SIZE" not in os.environ:  # the launcher; under torchrun, rank 0 decides (decide_resume)
        ckpt.check_resume(cfg, "rl")
        check_dataset_envs(cfg.env, cfg.eval.env)  # reads the files once; the controller reads them again
    cuda = use_cuda(cfg.dist.device)
    if not cuda:
        launching.check_cpu_cores(cfg)
    lay = cfg.layout
    colocated = resolve_colocation(lay.colocate, lay.num_trainer_ranks, lay.num_inference_ranks,
                                   cfg.inference.tensor_parallel, cuda)
    if colocated and cfg.inference.prefill_ranks:
        raise ValueError(f"inference.prefill_ranks ({cfg.inference.prefill_ranks}) > 0 needs the split layout, but "
                         "layout.colocate = auto colocates on this node (fewer GPUs than ranks): set layout.colocate = "
                         "false and give every rank a GPU")
    if cuda and "WORLD_SIZE" not in os.environ:  # the launcher, on the node the job runs on
        gpus = lay.num_trainer_ranks if colocated else lay.num_trainer_ranks + lay.num_inference_ranks
        if gpus > torch.cuda.device_count():
            what = "colocated trainer ranks (each with its engine)" if colocated else "trainer + inference ranks"
            raise ValueError(f"layout: {gpus} {what} need {gpus} GPUs, this node has {torch.cuda.device_count()}")
        if colocated and lay.colocate == "auto":
            print(f"meshrl: layout.colocate = auto: {lay.num_trainer_ranks} trainer rank(s) share the node's "
                  f"{torch.cuda.device_count()} GPU(s) with {lay.num_inference_ranks} engine(s) (colocated layout)",
                  file=sys.stderr)
    if colocated and cuda:
        memory.check(cfg)


def launch(cfg: RLConfig) -> int:
    """Run `cfg` as a torchrun job on this node (the Python entry point); returns the exit code.

    Raises ValueError for a config that cannot run here (missing model folder, too few GPUs).
    """
    preflight(cfg)
    return launching.launch(cfg, MODULE, PRELOAD)


def main(argv: list[str] | None = None) -> None:
    launching.rank_main(RLConfig, sys.argv[1:] if argv is None else argv, preflight, "starting", run_rank)


def run_rank(cfg: RLConfig, run_dir: Path) -> None:
    """Start the process group, agree on roles, build the layout, run this rank's role."""
    cuda = use_cuda(cfg.dist.device)
    lay = cfg.layout
    colocated = resolve_colocation(lay.colocate, lay.num_trainer_ranks, lay.num_inference_ranks,
                                   cfg.inference.tensor_parallel, cuda)
    device = pick_device(cuda, lay.num_trainer_ranks if colocated else None)
    rank, world = init_world(cuda, cfg.dist.timeout_s)
    roles = assign_roles(world, lay.num_trainer_ranks, lay.num_inference_ranks, find_controller(device),
                         cfg.inference.tensor_parallel, colocated, cfg.inference.prefill_ranks)
    role = roles.role_of(rank)
    setup_logging(run_dir, rank, role)
    layout = build_layout(roles, rank, device, cfg.dist.timeout_s, cfg.dist.message_timeout_s, cuda,
                          cfg.trainer.parallel.dims(cfg.layout.num_trainer_ranks))
    log.info("pid %d; roles: controller %d, trainers %s, inference %s%s; device %s", os.getpid(), roles.controller,
             roles.trainers, roles.inference, " (colocated in pairs)" if colocated else "", layout.device)
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
        from meshrl.envs import make_env
        from meshrl.runtime.policy import load_tokenizer_for
        from meshrl.runtime.rollout.controller import Controller
        from meshrl.runtime.rundir import MetricsWriter, record_restart, restart_count, write_config
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
        from meshrl.runtime.train.loop import run_trainer

        run_trainer(cfg, layout, start, ckpt_group)
    else:
        from meshrl.runtime.engine.loop import run_inference

        run_inference(cfg, layout, start or 0)


if __name__ == "__main__":
    main()
