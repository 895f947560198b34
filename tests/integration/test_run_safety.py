"""End to end on CPU, real processes under torchrun (issue 13): runs that cannot be hijacked,
orphaned or silently corrupted.

- one run directory, two jobs: a second job on it is refused while the first runs; Ctrl-C (SIGINT
  to `meshrl`) stops the first within seconds, exit 130, one line, no traceback, no process left;
  the resume skips a crafted checkpoint whose metadata would unpickle a payload (which never runs),
  a malformed manifest and a shard with flipped bytes (one warning line each) and continues from
  the previous good checkpoint; a rank frozen with SIGSTOP ends the job within the heartbeat
  timeout, named with its role and last activity;
- SIGKILL of the torchrun agent leaves no process behind;
- a full disk (a small tmpfs; skipped where none can be mounted) costs one checkpoint, warned and
  counted, and the run goes on;
- a run whose rollouts all fail stops after checkpoint.every steps.

Each job is the debug model for a few steps; the waits are generous (a loaded 2-core machine),
the assertions are about outcomes and messages, not durations.
"""

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.integration.test_resume import CONFIG, ROOT, command
from tests.unit.test_checkpoint import plant_exploit

pytestmark = pytest.mark.slow


@pytest.fixture
def config(tmp_path) -> str:
    path = tmp_path / "tiny.toml"
    path.write_text(CONFIG)
    return str(path)


def start(*args) -> subprocess.Popen:
    return subprocess.Popen(command(*args), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for(predicate, timeout=180.0, proc: subprocess.Popen | None = None):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the job ended early ({proc.returncode}):\n{proc.communicate()[1][-4000:]}")
        time.sleep(0.1)
    raise AssertionError("timed out waiting")


def rank_pids(run: Path) -> dict[str, int]:
    """role -> pid of every rank, from the `pid N;` line each rank logs at start."""
    out = {}
    for log in (run / "logs").glob("rank*-*.log"):
        text = log.read_text()
        if "pid " in text:
            out[log.stem.split("-", 1)[1]] = int(text.rsplit("pid ", 1)[1].split(";")[0])
    return out


def children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie has exited; its parent (init) has not reaped it yet


def assert_all_gone(pids, within=15.0):
    deadline = time.time() + within
    while time.time() < deadline and any(alive(p) for p in pids):
        time.sleep(0.1)
    assert not [p for p in pids if alive(p)], f"processes left behind: {[p for p in pids if alive(p)]}"


def metrics_steps(run: Path) -> list[int]:
    path = run / "metrics.jsonl"
    return [json.loads(line)["step"] for line in path.read_text().splitlines()] if path.is_file() else []


def test_one_run_dir_ctrl_c_crafted_and_damaged_checkpoints_and_a_frozen_rank(config, tmp_path, capsys):
    run = tmp_path / "run"
    common = ("rl", "@", config, "--checkpoint.every", "2", "--checkpoint.keep-last", "4", "--output-dir", str(run))
    ckpts = run / "checkpoints"

    # job 1: a second job on the same directory is refused; Ctrl-C (SIGINT to `meshrl`, as a terminal
    # sends it: the agent has a session of its own) stops the job within seconds, exit 130, one line
    job = start(*common, "--max-steps", "200")
    wait_for(lambda: (ckpts / "step_8" / "COMPLETE").is_file(), proc=job)  # four checkpoints
    from meshrl.runtime.cli import main  # `meshrl rl ...` in this process: its pre-flight refuses at once

    with pytest.raises(SystemExit) as second:
        main([*common, "--max-steps", "200", "--resume", "auto"])
    err = capsys.readouterr().err
    assert second.value.code == 2 and err.strip().count("\n") == 0, err  # one line
    assert f"is in use by another job (host {os.uname().nodename} pid {job.pid}" in err
    first = rank_pids(run)
    pids = [job.pid, *children(job.pid), *first.values()]
    assert len(pids) == 5  # launcher, agent, three ranks
    job.send_signal(signal.SIGINT)
    _, err = job.communicate(timeout=60)
    assert job.returncode == 130, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    lines = [line for line in err.splitlines() if line.startswith("meshrl:")]
    assert len(lines) == 1 and lines[0].startswith("meshrl: interrupted (Ctrl-C) after "), err[-3000:]
    assert f"of 200 steps; the latest checkpoint is step_" in lines[0]
    assert f"resume with `meshrl rl @ {run}/config.json --resume`" in lines[0]
    assert_all_gone(pids)

    # job 2: the newest checkpoint is crafted (valid checksums, DCP classes only: its metadata declares
    # a parameter as bytes in a torch.save blob whose unpickling runs a command), the one before has a
    # malformed manifest, the one before that 4 KiB of flipped bytes in a shard: the resume skips all
    # three, one warning line each, and the payload never runs. Then the inference rank freezes: the
    # heartbeats end the job and name it.
    from meshrl.runtime.checkpoint import list_steps

    good, flipped, malformed, crafted = list_steps(ckpts)[-4:]
    marker = tmp_path / "PWNED"
    plant_exploit(ckpts / f"step_{crafted}", marker)
    manifest = json.loads((ckpts / f"step_{malformed}" / "COMPLETE").read_text())
    del manifest["files"]
    (ckpts / f"step_{malformed}" / "COMPLETE").write_text(json.dumps(manifest))
    shard = ckpts / f"step_{flipped}" / "trainer" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[4096:8192] = bytes(b ^ 0xFF for b in data[4096:8192])
    shard.write_bytes(bytes(data))
    job = start(*common, "--max-steps", "200", "--resume", "--dist.heartbeat-timeout-s", "5")
    restarts = run / "restarts.jsonl"
    wait_for(lambda: restarts.is_file() and set(rank_pids(run).values()).isdisjoint(first.values())
             and metrics_steps(run)[good:] and len(metrics_steps(run)) >= good + 2, proc=job)  # steps good.. again
    pids = [job.pid, *children(job.pid), *rank_pids(run).values()]
    frozen = rank_pids(run)["inference"]
    # The watcher names a frozen rank by its last heartbeat. The role is published within one poll
    # (at most 0.5 s) of the rank learning it, so wait three beat intervals before freezing it. Twice,
    # on a loaded 2-core machine, a freeze right after the steps found the last beat still
    # "starting": the tiny model's steps came within a beat of the role.
    from meshrl.runtime.liveness import interval_for

    time.sleep(3 * interval_for(5))
    os.kill(frozen, signal.SIGSTOP)
    try:
        _, err = job.communicate(timeout=120)
    finally:
        if alive(frozen):
            os.kill(frozen, signal.SIGKILL)
    assert job.returncode != 0 and not marker.exists()
    assert (f"skipping checkpoint {ckpts}/step_{crafted}: trainer/.metadata declares ['model.tok_embeddings.weight'] "
            "as pickled objects (BytesStorageMetadata)") in err, err[-5000:]
    assert f"skipping checkpoint {ckpts}/step_{malformed}: COMPLETE is malformed: no 'files'" in err
    assert f"skipping checkpoint {ckpts}/step_{flipped}: file trainer/__0_0.distcp does not match its checksum" in err
    assert json.loads(restarts.read_text().splitlines()[-1])["resumed_from"] == good
    lines = [line for line in err.splitlines() if line.startswith("meshrl: ")]
    assert lines[0].startswith("meshrl: rank 1 (inference) failed first: HeartbeatTimeout: rank 1 (inference) sent "
                               "no heartbeat for 5."), "\n".join(lines)
    assert "its last activity: '" in lines[0] and f"pid {frozen}" in lines[0]
    assert_all_gone(pids)


def test_sigkill_of_the_torchrun_agent_leaves_no_process(config, tmp_path):
    run = tmp_path / "run"
    job = start("rl", "@", config, "--max-steps", "200", "--output-dir", str(run))
    wait_for(lambda: len(rank_pids(run)) == 3, proc=job)
    agent = children(job.pid)
    pids = [job.pid, *agent, *rank_pids(run).values()]
    assert len(agent) == 1
    os.kill(agent[0], signal.SIGKILL)
    assert_all_gone(pids)  # the ranks die with their agent (parent-death signal), the launcher returns
    _, err = job.communicate(timeout=30)
    assert job.returncode != 0 and "meshrl: the torchrun agent was killed (SIGKILL)" in err, err[-3000:]


def test_a_full_disk_costs_one_checkpoint_and_the_run_goes_on(config, tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        run, filler = disk / "run", disk / "filler"
        # synchronous saves: while an asynchronous save's partial shard fills the disk, the
        # controller's own writes (metrics.jsonl) could fail too, which is not what this tests
        job = start("rl", "@", config, "--max-steps", "12", "--checkpoint.every", "4", "--checkpoint.async-save",
                    "false", "--output-dir", str(run))
        wait_for(lambda: (run / "checkpoints" / "step_4" / "COMPLETE").is_file(), proc=job)
        st = os.statvfs(disk)
        filler.write_bytes(b"\0" * (st.f_bavail * st.f_frsize - 256 * 1024))  # the next shard does not fit
        trainer_log = run / "logs" / "rank0-trainer.log"
        wait_for(lambda: "no space left on device" in trainer_log.read_text(), proc=job)
        filler.unlink()
        _, err = job.communicate(timeout=120)
        assert job.returncode == 0, err[-4000:]
        assert f"checkpoint step_8 failed: no space left on device ({run}/checkpoints/step_8.tmp" in err, err[-3000:]
        assert "the previous checkpoint (step_4) is kept" in err
        assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["final", "step_12", "step_4"]
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == list(range(12)) and rows[-1]["checkpoint/failed_saves"] == 1
    finally:
        subprocess.run(["umount", str(disk)], check=True)


def test_a_run_whose_rollouts_all_fail_stops(config, tmp_path):
    run = tmp_path / "run"
    # scoring in a child with 1 MiB of address space to spare: every reward call fails
    r = subprocess.run(command("rl", "@", config, "--max-steps", "50", "--checkpoint.every", "2",
                               "--episodes.score-memory-mb", "1", "--output-dir", str(run)),
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode != 0
    assert ("meshrl: rank 2 (controller) failed first: meshrl.runtime.rundir.NotTrainingError: the run is not "
            "training: in each of its last 2 steps (0-1) every rollout failed") in r.stderr, r.stderr[-4000:]
    assert metrics_steps(run) == [0, 1] and not (run / "checkpoints" / "step_2").exists()
