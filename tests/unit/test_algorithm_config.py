"""The [trainer.loss] and [advantage] sections: each loss's own fields, resolved defaults, one-line refusals."""

import json

import pytest

from meshrl.runtime.config import ConfigError, LossConfig, RLConfig, load_config

FRESH = ["--model.flavor", "debug", "--model.tokenizer", "char"]


def test_loss_defaults_and_resolved_parameters():
    assert LossConfig().type == "dppo" and LossConfig().params == {"delta_low": 0.2, "delta_high": 0.2}
    assert LossConfig().kl_coef == 2e-3  # prime-rl's kl_tau = 1e-3 (docs/algorithms.md)
    assert LossConfig(type="aipo").params == {"ratio_cap": 8.0}
    assert LossConfig(type="ppo_clip").params == {"clip_low": 0.2, "clip_high": 0.2}
    assert LossConfig(type="gspo").params == {"clip_low": 3e-4, "clip_high": 4e-4}
    assert LossConfig(type="cispo", clip_high=2.0).params == {"clip_low": 1.0, "clip_high": 2.0}
    assert LossConfig(correction="tis").correction_bounds == (0.0, 2.0)
    assert LossConfig(correction="icepop", correction_high=3.0).correction_bounds == (0.5, 3.0)


@pytest.mark.parametrize("argv, message", [
    (["--trainer.loss.type", "ppo_clip", "--trainer.loss.delta-low", "0.3"],
     "trainer.loss.delta_low applies to loss type dppo, not 'ppo_clip'"),
    (["--trainer.loss.clip-high", "0.28"], "trainer.loss.clip_high applies to loss type ppo_clip, gspo, cispo"),
    (["--trainer.loss.correction-high", "3.0"], "trainer.loss.correction_high applies to correction tis | mis | icepop"),
    (["--trainer.loss.correction", "mis", "--trainer.loss.correction-low", "0.5"],
     "trainer.loss.correction_low applies to correction icepop, not 'mis'"),
    (["--trainer.loss.type", "gspo", "--layout.num-trainer-ranks", "2", "--trainer.parallel.cp", "2"],
     'trainer.loss.type = "gspo" needs whole samples on one rank'),
    (["--advantage.type", "ppo"], "advantage.type"),
    (["--advantage.min-pass-rate", "0.8", "--advantage.max-pass-rate", "0.2"],
     "advantage.min_pass_rate (0.8) > advantage.max_pass_rate (0.2)"),
])
def test_refusals_are_one_line(argv, message):
    with pytest.raises(ConfigError) as e:
        load_config(RLConfig, FRESH + argv)
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("loss", ["dppo", "aipo", "ppo_clip", "gspo", "cispo"])
def test_resolved_config_round_trips(loss):
    # a run's config.json holds every field (the other types' at their defaults) and loads back
    cfg, _ = load_config(RLConfig, FRESH + ["--trainer.loss.type", loss, "--trainer.loss.correction", "icepop",
                                            "--advantage.type", "rloo"])
    again = RLConfig.model_validate(json.loads(cfg.model_dump_json()))
    assert again == cfg and again.trainer.loss.type == loss and again.advantage.type == "rloo"
