import pytest

from orchestration.training.elastic import count_in_ranges, merge_ranges, plan_batch


@pytest.mark.parametrize("global_batch, world", [(32, 1), (32, 2), (32, 4), (32, 8), (16, 3), (64, 31), (7, 7)])
def test_global_batch_constant_across_world_sizes(global_batch, world):
    plan = plan_batch(global_batch_size=global_batch, micro_batch_size=4, world_size=world)
    # Every sample of the global batch is covered exactly once by the (rank, micro-step) slices ...
    covered = sorted(i for r in range(world) for a in range(plan.grad_accum)
                     for i in range(*plan.sample_slice(r, a)))
    assert covered == list(range(global_batch))
    # ... and the loss weights average (over ranks, as FSDP does) to exactly the global-batch mean.
    weights = [plan.loss_weight(end - start) for r in range(world) for a in range(plan.grad_accum)
               for start, end in [plan.sample_slice(r, a)]]
    assert sum(weights) / world == pytest.approx(1.0)
    assert all(len(range(*plan.sample_slice(r, a))) <= plan.micro_batch_size
               for r in range(world) for a in range(plan.grad_accum))


def test_even_split_uses_the_configured_micro_batch():
    plan = plan_batch(global_batch_size=16, micro_batch_size=4, world_size=2)
    assert (plan.micro_batch_size, plan.grad_accum, plan.even) == (4, 2, True)
    plan = plan_batch(global_batch_size=12, micro_batch_size=4, world_size=2)  # 6 per worker
    assert (plan.micro_batch_size, plan.grad_accum) == (3, 2)


def test_uneven_split_runs_the_same_number_of_micro_steps_on_every_rank():
    plan = plan_batch(global_batch_size=16, micro_batch_size=4, world_size=3)  # chunks 6, 5, 5
    assert [plan.rank_range(r) for r in range(3)] == [(0, 6), (6, 11), (11, 16)]
    assert plan.grad_accum == 2 and not plan.even


def test_batch_smaller_than_world_is_a_clear_error():
    with pytest.raises(ValueError, match="smaller than 3 workers"):
        plan_batch(global_batch_size=2, micro_batch_size=4, world_size=3)


def test_ranges_merge_and_count():
    assert merge_ranges([[8, 16], [0, 8], [20, 24]]) == [[0, 16], [20, 24]]
    assert count_in_ranges([[0, 16], [20, 24]]) == 20
