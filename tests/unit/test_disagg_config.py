"""Prefill/decode disaggregation: one-line config errors before any process starts, the roles, the
controller's pool balancing and relay (runtime/rollout/disagg.py), and engines it refuses."""

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from meshrl.runtime import protocol, rl, transport
from meshrl.runtime.config import ConfigError, RLConfig, validate
from meshrl.runtime.layout import assign_roles
from meshrl.runtime.rollout.disagg import DisaggRouter
from meshrl.runtime.transport import Message

ROOT = Path(__file__).resolve().parents[2]
MODEL = {"flavor": "debug", "tokenizer": "char"}


@pytest.mark.parametrize("raw, message", [
    ({"inference": {"prefill_ranks": 1}},
     "inference.prefill_ranks (1) must be smaller than the number of engine replicas (1)"),
    ({"inference": {"prefill_ranks": 2}, "layout": {"num_inference_ranks": 2}},
     "inference.prefill_ranks (2) must be smaller than the number of engine replicas (2)"),
    ({"inference": {"prefill_ranks": 1, "tensor_parallel": 2}, "layout": {"num_inference_ranks": 4}},
     "inference.prefill_ranks (1) > 0 is not supported with inference.tensor_parallel (2) > 1"),
    ({"inference": {"prefill_ranks": 1, "backend": "vllm"}, "layout": {"num_inference_ranks": 2}},
     'inference.prefill_ranks (1) > 0 needs inference.backend = "native"'),
    ({"inference": {"prefill_ranks": 1}, "layout": {"num_inference_ranks": 2, "num_trainer_ranks": 2,
                                                     "colocate": True}},
     "inference.prefill_ranks (1) > 0 needs the split layout (layout.colocate = false)"),
])
def test_unsupported_disaggregation_settings_fail_with_one_line(raw, message):
    with pytest.raises(ConfigError) as e:
        validate(RLConfig, {"model": MODEL, **raw})
    assert message in str(e.value) and "\n" not in str(e.value)


def test_meshrl_eval_refuses_it():
    from meshrl.runtime.config import EvalConfig

    with pytest.raises(ConfigError, match=r"inference.prefill_ranks \(1\) must be 0: meshrl eval runs one engine"):
        validate(EvalConfig, {"model": MODEL, "inference": {"prefill_ranks": 1}})


def test_supported_settings_validate():
    cfg = validate(RLConfig, {"model": MODEL, "inference": {"prefill_ranks": 2}, "layout": {"num_inference_ranks": 3}})
    assert cfg.inference.prefill_ranks == 2
    assert validate(RLConfig, {"model": MODEL}).inference.prefill_ranks == 0


def test_the_cli_exits_2_before_starting_anything(tmp_path):
    r = subprocess.run([sys.executable, "-m", "meshrl.runtime.cli", "rl", "--model.flavor", "debug",
                        "--model.tokenizer", "char", "--inference.prefill-ranks", "1", "--output-dir",
                        str(tmp_path / "run")], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "inference.prefill_ranks (1) must be smaller than the number of engine replicas (1)" in r.stderr
    assert not (tmp_path / "run").exists()


def test_auto_colocation_is_refused_in_preflight(monkeypatch, tmp_path):
    cfg = validate(RLConfig, {"model": MODEL, "inference": {"prefill_ranks": 1}, "output_dir": str(tmp_path / "r"),
                              "layout": {"num_inference_ranks": 2}, "dist": {"device": "cpu"}})
    monkeypatch.setattr(rl, "resolve_colocation", lambda *args: True)  # a node with fewer GPUs than ranks
    with pytest.raises(ValueError, match=r"inference.prefill_ranks \(1\) > 0 needs the split layout, but "
                                         "layout.colocate = auto colocates"):
        rl.preflight(cfg)


def test_roles_split_the_replicas_into_pools():
    roles = assign_roles(6, 1, 4, controller=0, prefill_replicas=1)
    assert roles.engines == (2, 3, 4, 5) and roles.prefill_engines == (2,) and roles.decode_engines == (3, 4, 5)
    plain = assign_roles(6, 1, 4, controller=0)
    assert plain.prefill_engines == () and plain.decode_engines == plain.engines


def test_the_router_balances_both_pools_and_relays_handoffs(monkeypatch):
    sent = []
    monkeypatch.setattr(transport, "send", lambda msg, dst, group: sent.append((dst, msg)))
    roles = assign_roles(6, 1, 4, controller=0, prefill_replicas=2)  # prefill 2, 3; decode 4, 5
    layout = SimpleNamespace(roles=roles, down={r: f"down{r}" for r in roles.inference})
    where: dict = {}
    pd = DisaggRouter(layout, where, backlog_tokens=10**6)
    homes = [pd.home([("train", 0, g, j) for j in range(2)]) for g in range(3)]
    assert homes == [4, 5, 4]  # fewest episodes in flight, ties to the lowest rank
    where.update({0: ("train", 0, 0, 0), 1: ("train", 0, 0, 1), 2: ("train", 0, 1, 0)})
    pd.send(4, {"max_tokens": 4}, [0, 1], [[1, 2, 3], [1, 2, 3]], [7, 8])
    pd.send(5, {"max_tokens": 4}, [2], [[4]], [9])
    (d1, m1), (d2, m2) = sent
    assert (d1, m1.meta["decode"], m1.data["request_id"].tolist()) == (2, 4, [0, 1])  # first turns: prefill
    assert (d2, m2.meta["decode"]) == (3, 5)  # the other prefill replica: fewer prompt tokens outstanding
    assert pd.prefill_load == {2: 3, 3: 1}  # a group's prompt is prefilled once: counted once
    sent.clear()
    where[3] = ("train", 0, 0, 0)  # the episode's second turn: straight to its home
    pd.send(4, {"max_tokens": 4}, [3], [[1, 2, 3, 9, 9]], [10])
    assert sent[0][0] == 4 and "decode" not in sent[0][1].meta
    sent.clear()
    data = protocol.generate([0], [[1]], [0], {}).data  # any payload with request ids
    pd.on_prefilled(Message(protocol.Kind.PREFILLED, {"handoff": 7, "dst": 4}, data, src=2))
    (p, send_kv), (d, recv_kv) = sent
    assert (p, send_kv.kind, send_kv.meta) == (2, protocol.Kind.SEND_KV, {"handoff": 7})
    assert (d, recv_kv.kind, recv_kv.meta["src"], recv_kv.meta["drop"]) == (4, protocol.Kind.RECV_KV, 2, [])
    assert pd.prefill_load == {2: 0, 3: 1}  # request 0 (which carried its group's prompt) left
    pd.on_completions([1])  # finished at its first token on the prefill replica
    assert pd.prefill_load == {2: 0, 3: 1}
    pd.episode_done(("train", 0, 0, 0))
    assert pd.decode_load == {4: 3, 5: 2}


def _pools(monkeypatch, backlog_tokens: int):
    """A router over prefill replica 2 and decode replicas 3, 4, and the messages it sends."""
    sent = []
    monkeypatch.setattr(transport, "send", lambda msg, dst, group: sent.append((dst, msg)))
    roles = assign_roles(5, 1, 3, controller=0, prefill_replicas=1)
    layout = SimpleNamespace(roles=roles, down={r: f"down{r}" for r in roles.inference})
    return DisaggRouter(layout, {}, backlog_tokens), sent


def _dispatch(pd: DisaggRouter, first_id: int, groups: int, prompt_len: int) -> None:
    """`groups` groups of 4 samples of one long prompt each, as the controller dispatches a step."""
    for g in range(groups):
        ids = list(range(first_id + 4 * g, first_id + 4 * g + 4))
        keys = [("train", first_id, g, j) for j in range(4)]
        pd.where.update(zip(ids, keys))
        rank = pd.home(keys)
        pd.send(rank, {"max_tokens": 4}, ids, [[g] * prompt_len] * 4, ids)


def _prefilled_tokens(sent) -> dict[int, int]:
    """Prompt tokens each rank is asked to prefill (a group's prompt once)."""
    out: dict[int, int] = {}
    for dst, msg in sent:
        prompts = {tuple(p.tolist()) for p in msg.data["prompt_ids"].split(msg.data["prompt_lens"].tolist())}
        out[dst] = out.get(dst, 0) + sum(len(p) for p in prompts)
    return out


def test_a_backed_up_prefill_pool_hands_first_turns_to_the_decode_pool(monkeypatch):
    """Skewed load: 12 groups of long prompts at once. Without the backlog rule the one prefill
    replica gets every prompt (36k tokens) and the decode replicas nothing to do until it catches up;
    with it, the prefill replica takes prompts until it has backlog_tokens outstanding and the rest
    are prefilled by their decode replicas (a group stays together, so it is still prefilled once)."""
    pd, sent = _pools(monkeypatch, backlog_tokens=10**9)
    _dispatch(pd, 0, groups=12, prompt_len=3000)
    assert _prefilled_tokens(sent) == {2: 36000}
    assert all("decode" in msg.meta and msg.meta["decode"] in (3, 4) for _, msg in sent)

    pd, sent = _pools(monkeypatch, backlog_tokens=8000)
    _dispatch(pd, 0, groups=12, prompt_len=3000)
    # 3 prompts reach 9000 >= 8000 tokens outstanding; groups 3-11 go to their homes (4, 3, 4, ...)
    assert _prefilled_tokens(sent) == {2: 9000, 3: 12000, 4: 15000}
    assert pd.num_first_turns == {"prefill": 12, "decode": 36} and pd.prefill_load == {2: 9000}
    direct = [msg for dst, msg in sent if dst != 2]
    assert all("decode" not in msg.meta for msg in direct)  # prefilled where they decode: no handoff
    # the prefill replica hands two groups off: below the backlog again, the next group goes to it
    for rid in (0, 4):
        pd.on_prefilled(Message(protocol.Kind.PREFILLED, {"handoff": rid, "dst": 3},
                                protocol.generate([rid], [[1]], [0], {}).data, src=2))
    assert pd.prefill_load == {2: 3000}
    sent.clear()
    _dispatch(pd, 100, groups=2, prompt_len=3000)
    assert _prefilled_tokens(sent) == {2: 6000}  # 3000 < 8000, then 6000 < 8000
    assert pd.prefill_load == {2: 9000}
    # a prompt longer than the backlog still goes to an idle prefill replica
    pd, sent = _pools(monkeypatch, backlog_tokens=100)
    _dispatch(pd, 0, groups=2, prompt_len=3000)
    assert _prefilled_tokens(sent) == {2: 3000, 4: 3000}


def test_aborts_reach_every_replica_that_may_hold_the_request(monkeypatch):
    pd, sent = _pools(monkeypatch, backlog_tokens=10**6)
    pd.where.update({0: "a", 1: "b", 2: "c"})
    pd.home(["a", "b", "c"])  # all homed on 3
    pd.send(3, {"max_tokens": 4}, [0, 1, 2], [[1, 2], [3, 4], [5, 6]], [0, 1, 2])
    sent.clear()
    pd.abort([0, 7])  # 0 is on the prefill replica (queued or parked); 7 is not in flight
    assert [(dst, msg.kind, msg.meta) for dst, msg in sent] == [
        (2, protocol.Kind.ABORT, {"request_ids": [0]}), (3, protocol.Kind.ABORT, {"request_ids": [0]})]
    sent.clear()
    # the handoff that holds 0 and 1 arrives after the abort: the decode replica must not take 0
    data = protocol.generate([0, 1], [[1, 2], [3, 4]], [0, 1], {}).data
    pd.on_prefilled(Message(protocol.Kind.PREFILLED, {"handoff": 0, "dst": 3}, data, src=2))
    (_, send_kv), (_, recv_kv) = sent
    assert send_kv.meta == {"handoff": 0} and recv_kv.meta["drop"] == [0]
    assert not pd.aborted
    sent.clear()
    pd.abort([1])  # handed off: only the decode replica holds it
    assert [(dst, msg.meta["request_ids"]) for dst, msg in sent] == [(3, [1])]
    sent.clear()
    pd.on_completions([0, 1])  # their abort completions
    pd.abort([0, 1])  # finished: nothing to abort
    assert not sent and pd.decode_of == {2: 3}


def test_engines_with_recurrent_state_are_refused():
    from meshrl.runtime.engine.disagg import DecodeRole, PrefillRole
    from tests.family_checks import make_engine
    from tests.unit.test_qwen3_next import build, tiny

    engine = make_engine(build(tiny("next")))
    for role in (PrefillRole, DecodeRole):
        with pytest.raises(ValueError, match="not supported for models with linear-attention layers"):
            role(engine, None)


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5"])
def test_models_with_linear_attention_are_refused_in_preflight(family, tmp_path):
    cfg = validate(RLConfig, {"model": {**MODEL, "family": family}, "inference": {"prefill_ranks": 1},
                              "layout": {"num_inference_ranks": 2}, "dist": {"device": "cpu"},
                              "output_dir": str(tmp_path / "r")})
    with pytest.raises(ValueError, match=rf"inference.prefill_ranks \(1\) > 0 is not supported for the {family} "
                                         "model: its 3 linear-attention layers"):
        rl.preflight(cfg)


def test_the_cli_refuses_linear_attention_with_one_line_before_starting_ranks(tmp_path):
    r = subprocess.run([sys.executable, "-m", "meshrl.runtime.cli", "rl", "--model.family", "qwen3_next",
                        "--model.flavor", "debug", "--model.tokenizer", "char", "--inference.prefill-ranks", "1",
                        "--layout.num-inference-ranks", "2", "--dist.device", "cpu", "--output-dir",
                        str(tmp_path / "run")], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "inference.prefill_ranks (1) > 0 is not supported for the qwen3_next model" in r.stderr
    assert not (tmp_path / "run").exists()  # no run folder, so no rank ever started


def test_a_late_handoff_at_shutdown_is_not_relayed(monkeypatch):
    """PREFILLED arriving after STOP went out: relaying it would make the controller's send_kv /
    recv_kv wait on ranks that are stopping (transport.send blocks until received)."""
    from meshrl.runtime.rollout.controller import Controller

    sent = []
    monkeypatch.setattr(transport, "send", lambda msg, dst, group: sent.append((dst, msg.kind)))
    roles = assign_roles(4, 1, 2, controller=0, prefill_replicas=1)  # trainer 1, prefill 2, decode 3
    layout = SimpleNamespace(roles=roles, down={r: f"down{r}" for r in range(4)})
    data = protocol.generate([0], [[1]], [0], {}).data
    inbox = [Message(protocol.Kind.PREFILLED, {"handoff": 0, "dst": 3}, data, src=2),
             *(Message(protocol.Kind.DONE, src=r) for r in (1, 2, 3))]
    controller = object.__new__(Controller)  # only what _shutdown reads
    controller.layout, controller.pd = layout, DisaggRouter(layout, {}, 10**6)
    controller.cfg = SimpleNamespace(dist=SimpleNamespace(timeout_s=5))
    controller.inbox = SimpleNamespace(get=lambda timeout: inbox.pop(0))
    controller._shutdown()
    assert sent == [(2, protocol.Kind.STOP), (3, protocol.Kind.STOP), (1, protocol.Kind.STOP)]
