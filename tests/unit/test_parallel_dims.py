"""ParallelDims: degrees, validation errors and the rank grid behind the trainer's groups."""

import pytest

from meshrl.parallel.dims import ParallelDims, all_rank_lists
from meshrl.runtime.config import ParallelConfig, SFTConfig


def test_dp_shard_minus_one_takes_the_remaining_ranks():
    assert ParallelDims.resolve(8, dp_replicate=2, cp=2) == ParallelDims(2, 2, 2, 1)
    assert ParallelDims.resolve(3) == ParallelDims(1, 3, 1, 1)
    dims = ParallelDims.resolve(8, dp_replicate=2, dp_shard=2, cp=2, ep=4)
    assert dims.num_ranks == 8 and dims.num_data_ranks == 4


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_ranks=4, dp_shard=3), "x cp.*= 3, but there are 4 trainer ranks"),
    (dict(num_ranks=6, dp_replicate=4), "must divide the 6 trainer ranks"),
    (dict(num_ranks=4, dp_shard=4, ep=3), "ep \\(3\\) must divide dp_shard x cp \\(4\\)"),
    (dict(num_ranks=4, dp_replicate=2, dp_shard=2, ep=4), "ep \\(4\\) must divide dp_shard x cp \\(2\\)"),
    (dict(num_ranks=2, cp=0), "cp must be >= 1"),
    (dict(num_ranks=0), "at least one rank"),
])
def test_invalid_degrees_name_the_problem(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ParallelDims.resolve(**kwargs)


def test_config_rejects_bad_degrees_before_any_process_starts():
    with pytest.raises(ValueError, match="dp_shard \\(3\\)"):
        SFTConfig(num_ranks=4, model={"flavor": "debug", "tokenizer": "char"},
                  trainer={"parallel": {"dp_shard": 3}})
    with pytest.raises(ValueError, match="ac_every applies only"):
        ParallelConfig(ac_every=2)
    cfg = SFTConfig(num_ranks=4, model={"flavor": "debug", "tokenizer": "char"},
                    trainer={"parallel": {"dp_replicate": 2, "cp": 2}})
    assert cfg.trainer.parallel.dims(4) == ParallelDims(2, 1, 2, 1)


def test_coordinates_data_ranks_and_cp_ranks():
    dims = ParallelDims.resolve(8, dp_replicate=2, dp_shard=2, cp=2)
    # (replicate, shard, cp) row-major over the trainer ranks; cp is innermost
    assert [dims.coords(i) for i in range(4)] == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1)]
    assert [dims.data_rank(i) for i in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [dims.cp_rank(i) for i in range(8)] == [0, 1] * 4


def test_group_rank_lists_partition_the_trainer_ranks():
    ranks = [10, 11, 12, 13, 14, 15, 16, 17]  # global ranks of the trainers (controller elsewhere)
    dims = ParallelDims.resolve(8, dp_replicate=2, dp_shard=2, cp=2, ep=2)
    groups = all_rank_lists(dims, ranks)
    for name, lists in groups.items():
        flat = sorted(r for g in lists for r in g)
        assert flat == ranks, name  # every axis partitions the ranks exactly once
    assert groups["dp_shard_cp"] == [[10, 11, 12, 13], [14, 15, 16, 17]]
    assert groups["dp_replicate"] == [[10, 14], [11, 15], [12, 16], [13, 17]]
    assert groups["cp"] == [[10, 11], [12, 13], [14, 15], [16, 17]]
    # ep is innermost over dp_shard_cp; the ranks holding the same experts differ in the rest
    assert groups["ep"] == [[10, 11], [12, 13], [14, 15], [16, 17]]
    assert groups["dp_shard_mod_ep"] == [[10, 12], [11, 13], [14, 16], [15, 17]]
