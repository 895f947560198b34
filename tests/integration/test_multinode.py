"""Multi-node on one machine (CPU, gloo, real processes): two torchrun agents joined by the c10d
rendezvous form one job; a rank killed on one agent restarts both (`--max-restarts`); the Slurm
template runs under a stub `srun` that starts one agent per "node" locally, and a killed agent is
brought back by the template's relaunch (torchrun cannot restart a dead agent).

Which agent gets global ranks 0..k is the rendezvous' choice: it sorts the agents by
(address, pid). `--local-addr 127.0.0.1` / `127.0.0.2` (both loopback) forces the order where a
test needs it. The roles across agents for both orders, on CPU and on simulated GPU nodes, are
checked on gloo ranks without torchrun (fast). docs/multinode.md describes all of it.
"""

import datetime
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.dist.multirank import free_port, run_ranks

ROOT = Path(__file__).resolve().parents[2]
CONFIG = """
max_off_policy_steps = 0
prompts_per_step = 4
samples_per_prompt = 4
[model]
flavor = "debug"
tokenizer = "char"
[env]
name = "reverse-text"
seed = 1
[layout]
num_trainer_ranks = 2
num_inference_ranks = 2
[trainer]
micro_batch_tokens = 256
[trainer.optim]
lr = 1e-3
[inference]
max_num_seqs = 32
max_model_len = 48
[inference.sampling]
max_tokens = 12
[log]
console = false
"""
NUM_STEPS = 6
RUN_ARGS = ("--max-steps", str(NUM_STEPS), "--checkpoint.every", "2")
TIMEOUT_S = 600  # the whole job; a loaded 2-core machine takes ~1.5 min for one start of 5 ranks


# ----------------------------------------------------------------------------- roles (fast)


CASES = [(agents, gpus) for agents in ((2, 3), (3, 2)) for gpus in (0, 2)]  # (processes per agent, GPUs per node)


def _roles_across_agents(rank, world_size, out):
    """One rank of a job of two agents, for every case of CASES in turn: its agent's processes
    come first or second in the rendezvous, on CPU or on simulated nodes of 2 GPUs."""
    import torch.distributed as dist

    from meshrl.runtime import layout

    real = torch.cuda.is_available, torch.cuda.device_count, torch.cuda.set_device
    results = []
    for agents, gpus in CASES:
        node = int(rank >= agents[0])
        os.environ.update(LOCAL_RANK=str(rank - node * agents[0]), LOCAL_WORLD_SIZE=str(agents[node]))
        if gpus:  # a CUDA node as far as layout.py can tell, without touching a device
            torch.cuda.is_available, torch.cuda.device_count = (lambda: True), (lambda: gpus)
            torch.cuda.set_device = lambda index: None
        device = layout.pick_device(cuda=bool(gpus))
        roles = layout.assign_roles(world_size, 2, world_size - 3, layout.find_controller(device))
        torch.cuda.is_available, torch.cuda.device_count, torch.cuda.set_device = real
        seen = [None] * world_size
        dist.all_gather_object(seen, (roles.controller, roles.trainers, roles.inference, str(device)))
        results.append(seen)
    if rank == 0:
        Path(out).write_text(json.dumps(results))


def test_one_controller_job_wide_whichever_agent_gets_rank_0(tmp_path):
    out = tmp_path / "roles.json"
    run_ranks(_roles_across_agents, 5, str(out))
    for (agents, gpus), seen in zip(CASES, json.loads(out.read_text())):
        case = f"agents {agents}, {gpus} GPUs per node: {seen}"
        assert all(s[:3] == seen[0][:3] for s in seen), case  # every rank agrees
        controller, trainers, inference = seen[0][:3]
        first, second = range(agents[0]), range(agents[0], sum(agents))
        devices = [s[3] for s in seen]
        if gpus:
            # GPUs by local rank; the one process past its node's GPUs (the Slurm template's
            # extra process on the G+1 node) is the controller, whichever agent it is on
            big = first if agents[0] > agents[1] else second
            assert controller == big[-1], case
            want = [f"cuda:{r - n[0]}" if r != controller else "cpu" for n in (first, second) for r in n]
            assert devices == want, case
        else:
            assert controller == first[-1], case  # CPU: the last local rank of the agent with rank 0
            assert devices == ["cpu"] * sum(agents), case
        others = [r for r in range(sum(agents)) if r != controller]
        assert trainers == others[:2] and inference == others[2:], case  # roles by global rank


# ----------------------------------------------------------------------------- torchrun agents


@pytest.fixture
def config(tmp_path) -> str:
    path = tmp_path / "tiny.toml"
    path.write_text(CONFIG)
    return str(path)


def steps(run: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def check_metrics(run: Path) -> list[dict]:
    """Every step once, in order, and the numbers of a healthy synchronous run."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(NUM_STEPS))
    for r in rows:
        assert 0 <= r["reward/mean"] <= 1 and r["rollouts/failed"] == 0, r
        assert r["weights/version"] == r["step"] + 1 and r["policy_lag/max"] == 0, r
        # the engines (on either agent) sample with exactly the trainer's weights
        assert r["mismatch_kl"] < 1e-6 and torch.isfinite(torch.tensor(r["loss"])), r
    return rows


def roles_line(run: Path, rank: int, role: str) -> str:
    lines = [line for line in (run / "logs" / f"rank{rank}-{role}.log").read_text().splitlines() if "roles:" in line]
    return lines[-1].split("roles: ", 1)[1]


def wait_for(path: Path, procs: list[subprocess.Popen], timeout_s: float = TIMEOUT_S) -> None:
    deadline = time.time() + timeout_s
    while not path.is_file():
        if time.time() > deadline or any(p.poll() is not None for p in procs):
            raise AssertionError(f"{path} never appeared: exits {[p.poll() for p in procs]}")
        time.sleep(0.2)


def finish(procs: list[subprocess.Popen], timeout_s: float = TIMEOUT_S) -> list[tuple[int, str, str]]:
    """Wait for the processes (each in a session of its own): (exit code, stdout, stderr) of each;
    kill what is left on a timeout."""
    out = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=timeout_s)
            out.append((p.returncode, stdout or "", stderr))
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    return out


def agent(nproc: int, addr: str, port: int, config: str, run: Path, *torchrun: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", str(nproc),
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"localhost:{port}", "--rdzv-id", "mn",
           "--local-addr", addr, *torchrun, "-m", "meshrl.runtime.rl", "@", config, "--output-dir", str(run),
           *RUN_ARGS]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


@pytest.mark.slow
@pytest.mark.heavy
def test_two_agents_form_one_job_and_a_killed_rank_restarts_both(config, tmp_path):
    """Agents of 2 and 3 processes (the 2 first): one RL job of 5 ranks; a trainer rank of the
    second agent is killed after the checkpoint of step 2; both agents restart their ranks and
    the run resumes from that checkpoint, every step once."""
    run, port = tmp_path / "run", free_port()
    procs = [agent(2, "127.0.0.1", port, config, run, "--max-restarts", "1"),
             agent(3, "127.0.0.2", port, config, run, "--max-restarts", "1")]
    try:
        wait_for(run / "checkpoints" / "step_2" / "COMPLETE", procs)
        # global ranks 0-1 on the first agent, 2-4 on the second; rank 1 (last local rank of
        # the agent with rank 0) is the controller, trainers and engines follow by global rank
        assert roles_line(run, 2, "trainer").startswith("controller 1, trainers (0, 2), inference (3, 4)")
        pid = int((run / "logs" / "rank2-trainer.log").read_text().split("pid ")[1].split(";")[0])
        os.kill(pid, signal.SIGKILL)
    finally:
        results = finish(procs)
    assert [code for code, _, _ in results] == [0, 0], "\n".join(err[-3000:] for _, _, err in results)
    check_metrics(run)
    restarts = [json.loads(line) for line in (run / "restarts.jsonl").read_text().splitlines()]
    assert len(restarts) == 1 and restarts[0]["restart"] == 1 and restarts[0]["resumed_from"] in (2, 4), restarts
    for rank, role in [(0, "trainer"), (1, "controller"), (2, "trainer"), (3, "inference"), (4, "inference")]:
        assert roles_line(run, rank, role).startswith("controller 1, trainers (0, 2), inference (3, 4)")
        assert f"[rank {rank} {role} restart 1]" in (run / "logs" / f"rank{rank}-{role}.log").read_text()


def test_several_agents_that_may_restart_need_their_own_stores(config, tmp_path, monkeypatch, capsys):
    """Without TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 a restart over several agents would hang
    (layout.init_world): every rank refuses it up front, exit 2, one line."""
    from meshrl.runtime import launch
    from meshrl.runtime.config import RLConfig

    env = {"WORLD_SIZE": "5", "RANK": "3", "LOCAL_RANK": "0", "GROUP_WORLD_SIZE": "2",
           "TORCHELASTIC_MAX_RESTARTS": "1", "TORCHELASTIC_USE_AGENT_STORE": "True"}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    argv = ["@", config, "--output-dir", str(tmp_path / "run")]
    with pytest.raises(SystemExit) as exit_:
        launch.parse_or_exit(RLConfig, argv, launch.check_world_size)
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err == ("meshrl: torchrun --max-restarts over 2 agents needs TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in "
                   "every agent's environment (torchrun/slurm.sbatch sets it; see docs/multinode.md)"), err
    for ok in ({"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "TORCHELASTIC_USE_AGENT_STORE": "False"},
               {"TORCHELASTIC_MAX_RESTARTS": "0"}, {"GROUP_WORLD_SIZE": "1"}):
        with monkeypatch.context() as m:
            for key, value in ok.items():
                m.setenv(key, value)
            launch.parse_or_exit(RLConfig, argv, launch.check_world_size)


# ----------------------------------------------------------------------------- Slurm template

# The commands Slurm would provide, just enough of them for torchrun/slurm.sbatch: `srun` runs its
# command once per node of SLURM_JOB_NODELIST on this machine, with the variables slurmstepd sets
# per task, and ends the step when a task exits non-zero (--kill-on-bad-exit: SIGTERM, then
# SIGKILL after a grace period, like KillWait); `scontrol show hostnames` expands a node list.
SCONTROL = r'''#!/usr/bin/env python3
import re, sys
if sys.argv[1:3] != ["show", "hostnames"] or len(sys.argv) != 4:
    sys.exit(f"stub scontrol: unsupported {sys.argv[1:]}")
for part in re.findall(r"[^,\[]+(?:\[[^\]]*\])?", sys.argv[3]):
    m = re.fullmatch(r"(.*)\[(\d+)-(\d+)\]", part)
    names = [f"{m[1]}{i:0{len(m[2])}d}" for i in range(int(m[2]), int(m[3]) + 1)] if m else [part]
    print("\n".join(names))
'''
SRUN = r'''#!/usr/bin/env python3
import os, signal, subprocess, sys, time
args, kill_on_bad_exit = sys.argv[1:], False
while args and args[0].startswith("-"):
    opt = args.pop(0)
    if opt in ("--kill-on-bad-exit=1", "-K"):
        kill_on_bad_exit = True
    elif opt != "--ntasks-per-node=1":
        sys.exit(f"stub srun: unsupported option {opt}")
hosts = subprocess.run(["scontrol", "show", "hostnames", os.environ["SLURM_JOB_NODELIST"]], check=True,
                       capture_output=True, text=True).stdout.split()
assert len(hosts) == int(os.environ["SLURM_NNODES"]), (hosts, os.environ["SLURM_NNODES"])
stub = os.environ["STUB_DIR"]
step = len([f for f in os.listdir(stub) if f.endswith("node0.pid")])
tasks = []
for i, host in enumerate(hosts):
    env = {**os.environ, "SLURM_NODEID": str(i), "SLURM_PROCID": str(i), "SLURM_LOCALID": "0",
           "SLURM_NTASKS": str(len(hosts)), "SLURM_STEP_ID": str(step), "SLURM_STEP_NUM_NODES": str(len(hosts)),
           "SLURM_STEP_NODELIST": os.environ["SLURM_JOB_NODELIST"], "SLURMD_NODENAME": host}
    log = open(os.path.join(stub, f"step{step}-node{i}.log"), "w")
    tasks.append(subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
    with open(os.path.join(stub, f"step{step}-node{i}.pid"), "w") as f:
        f.write(str(tasks[-1].pid))
code, ended = 0, None
while any(t.poll() is None for t in tasks):
    bad = [t.returncode for t in tasks if t.returncode not in (None, 0)]
    if bad and kill_on_bad_exit and ended is None:
        code, ended = (128 - bad[0]) if bad[0] < 0 else bad[0], time.time()
        print(f"srun: error: a task exited {bad[0]}; terminating the step", file=sys.stderr, flush=True)
        for t in tasks:
            if t.poll() is None:
                os.killpg(t.pid, signal.SIGTERM)
    if ended is not None and time.time() - ended > 30:
        for t in tasks:
            if t.poll() is None:
                os.killpg(t.pid, signal.SIGKILL)
    time.sleep(0.1)
codes = [t.returncode for t in tasks]
sys.exit(code or next((c if c > 0 else 128 - c for c in codes if c), 0))
'''


@pytest.mark.slow
@pytest.mark.heavy
def test_slurm_template_relaunches_the_step_when_an_agent_is_killed(config, tmp_path):
    """torchrun/slurm.sbatch on 2 stub nodes with 2 "GPUs" each (CPU here): node 0 runs 3
    processes, node 1 runs 2; node 0's agent is SIGKILLed after the checkpoint of step 2, srun
    ends the step, and the template's relaunch resumes from that checkpoint."""
    bin_dir, stub_dir, run = tmp_path / "bin", tmp_path / "stub", tmp_path / "run"
    bin_dir.mkdir()
    stub_dir.mkdir()
    for name, text in (("srun", SRUN), ("scontrol", SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "GPUS_PER_NODE", "MAX_R"))}
    env.update(PATH=f"{bin_dir}:{env['PATH']}", STUB_DIR=str(stub_dir), SLURM_JOB_ID="4242", SLURM_NNODES="2",
               SLURM_JOB_NUM_NODES="2", SLURM_JOB_NODELIST="127.0.0.[1-2]", SLURM_SUBMIT_DIR=str(ROOT),
               SLURM_GPUS_ON_NODE="2", PYTHON=sys.executable, RDZV_PORT=str(free_port()), OMP_NUM_THREADS="1",
               MAX_RELAUNCHES="1")
    job = subprocess.Popen(["bash", str(ROOT / "torchrun" / "slurm.sbatch"), "rl", config, "--output-dir", str(run),
                            *RUN_ARGS], cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True, start_new_session=True)
    try:
        wait_for(run / "checkpoints" / "step_2" / "COMPLETE", [job])
        killed_at = datetime.datetime.now()
        os.kill(int((stub_dir / "step0-node0.pid").read_text()), signal.SIGKILL)  # node 0's torchrun agent
    finally:
        [(code, out, err)] = finish([job])
    logs = "\n".join(p.read_text()[-2000:] for p in sorted(stub_dir.glob("*.log")))
    assert code == 0, f"{err[-3000:]}\n{logs}"
    assert "meshrl rl on 2 nodes x 2 GPUs (+1 controller on node 0), rendezvous 127.0.0.1:" in out, out
    assert "the job step failed (exit 137); relaunch 1 of 1" in err, err
    assert sorted(p.name for p in stub_dir.glob("*.pid")) == [f"step{s}-node{n}.pid" for s in (0, 1) for n in (0, 1)]
    check_metrics(run)
    restarts = [json.loads(line) for line in (run / "restarts.jsonl").read_text().splitlines()]
    assert len(restarts) == 1 and restarts[0]["resumed_from"] in (2, 4), restarts
    # the relaunch: 5 ranks (3 on node 0, 2 on node 1) agreeing on one controller
    relaunched = [line.split("roles: ", 1)[1] for p in (run / "logs").glob("rank*-*.log")
                  for line in p.read_text().splitlines()
                  if "roles:" in line and datetime.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f") > killed_at]
    assert len(relaunched) == 5 and len(set(relaunched)) == 1, relaunched
