import pytest

from orchestration.elastic import count_in_ranges, merge_ranges, plan_batch


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_global_batch_constant_across_world_sizes(world):
    plan = plan_batch(global_batch_size=32, micro_batch_size=4, world_size=world)
    assert plan.world_size * plan.micro_batch_size * plan.grad_accum == 32
    # Every sample of the global batch is covered exactly once by (rank, micro-step) slices.
    covered = sorted(i for r in range(world) for a in range(plan.grad_accum)
                     for i in range(*plan.sample_slice(r, a)))
    assert covered == list(range(32))


def test_micro_batch_shrinks_to_divide():
    plan = plan_batch(global_batch_size=12, micro_batch_size=4, world_size=2)  # 6 per worker
    assert (plan.micro_batch_size, plan.grad_accum) == (3, 2)


def test_indivisible_global_batch_is_a_clear_error():
    with pytest.raises(ValueError, match="cannot be split evenly over 3 workers"):
        plan_batch(global_batch_size=16, micro_batch_size=4, world_size=3)


def test_ranges_merge_and_count():
    assert merge_ranges([[8, 16], [0, 8], [20, 24]]) == [[0, 16], [20, 24]]
    assert count_in_ranges([[0, 16], [20, 24]]) == 20
