"""The exponential-to-classic conversion of completion lengths, the reward's fixed buckets, and the names."""

from __future__ import annotations

import math
import random

import pytest

from rlpulse.sinks.prometheus import names
from rlpulse.sinks.prometheus.buckets import (ExpHistogram, downscale, exponential_to_classic, fixed_to_classic, merge,
                                             upper_bound)

pytestmark = pytest.mark.full


def index_of(value: float, scale: int) -> int:
    """Bucket of ``value`` at ``scale`` by the definition (i with base**i < value <= base**(i+1)), exact for the
    integer lengths used here: the smallest i whose upper bound reaches the value."""
    i = math.floor(math.log2(value) * 2**scale) - 2
    while upper_bound(i, scale) < value:
        i += 1
    return i


def histogram(values: list[int], scale: int) -> ExpHistogram:
    h = ExpHistogram(scale, count=len(values), sum=float(sum(values)))
    positive = [index_of(v, scale) for v in values if v > 0]
    h.zero_count = len(values) - len(positive)
    if positive:
        h.offset = min(positive)
        h.counts = [0] * (max(positive) - h.offset + 1)
        for i in positive:
            h.counts[i - h.offset] += 1
    return h


def test_upper_bounds_are_powers_of_two_at_scale_0_and_below():
    assert [upper_bound(i, 0) for i in (-1, 0, 1, 9)] == [1.0, 2.0, 4.0, 1024.0]
    assert [upper_bound(i, -1) for i in (0, 1, 2)] == [4.0, 16.0, 64.0]
    assert upper_bound(1, 1) == 2.0 and upper_bound(0, 1) == pytest.approx(math.sqrt(2))
    assert upper_bound(10**7, -10) == math.inf


def test_one_histogram_becomes_cumulative_le_buckets_at_each_bucket_upper_bound():
    # scale 1: base sqrt(2). 3 -> (2, 2.83]? no: 3 is in (2.83, 4], index 3; 4 -> index 3; 5 -> (4, 5.66], index 4
    h = histogram([0, 3, 4, 5, 5], scale=1)
    assert (h.zero_count, h.offset, h.counts) == (1, 3, [2, 2])
    assert exponential_to_classic(h) == [(upper_bound(2, 1), 1), (4.0, 3), (upper_bound(4, 1), 5), (math.inf, 5)]


def test_le_counts_equal_the_values_at_or_below_each_bound_for_random_lengths():
    rng = random.Random(3)
    values = [rng.choice([0, rng.randrange(1, 4096)]) for _ in range(500)]
    for scale in (-2, 0, 2, 4):
        pairs = exponential_to_classic(histogram(values, scale))
        assert pairs[-1] == (math.inf, len(values))
        for le, count in pairs[:-1]:
            assert count == sum(1 for v in values if v <= le), (scale, le)


def test_steps_of_different_scales_merge_at_the_lowest_scale_exactly():
    rng = random.Random(5)
    a = [rng.randrange(1, 300) for _ in range(200)]
    b = [rng.randrange(200, 5000) for _ in range(150)] + [0, 0]
    merged = merge([histogram(a, 5), histogram(b, 2)])
    assert merged is not None and merged.scale == 2
    assert (merged.count, merged.zero_count, merged.sum) == (352, 2, float(sum(a) + sum(b)))
    # the same as bucketing every value at scale 2 directly
    direct = histogram(a + b, 2)
    assert (merged.offset, merged.counts) == (direct.offset, direct.counts)
    for le, count in exponential_to_classic(merged)[:-1]:
        assert count == sum(1 for v in a + b if v <= le)


def test_downscaling_maps_bucket_i_to_i_shifted_right_negative_indices_too():
    h = ExpHistogram(3, zero_count=1, offset=-3, counts=[1, 0, 2, 0, 0, 0, 0, 0, 4], count=8, sum=1.0)
    low = downscale(h, 1)  # k = 2: -3 -> -1, -1 -> -1, 5 -> 1
    assert (low.offset, low.counts, low.zero_count, low.count) == (-1, [3, 0, 4], 1, 8)
    with pytest.raises(ValueError, match="cannot upscale"):
        downscale(h, 4)


def test_a_histogram_spanning_too_many_buckets_is_downscaled_until_it_fits():
    h = histogram([1, 2**20], scale=4)  # buckets -1 and 319 at scale 4: 321 buckets; at scale -2, -1 and 4: 6
    merged = merge([h], max_buckets=10)
    assert merged is not None and (merged.scale, merged.offset, merged.counts) == (-2, -1, [1, 0, 0, 0, 0, 1])
    assert exponential_to_classic(merged)[-2:] == [(2.0**20, 2), (math.inf, 2)]
    assert merge([]) is None


def test_only_zeros_give_the_inf_bucket_alone():
    h = histogram([0, 0, 0], scale=3)
    assert exponential_to_classic(h) == [(math.inf, 3)]


def test_fixed_buckets_accumulate_and_end_with_the_count():
    bounds = [0, 0.5, 1]
    assert fixed_to_classic(bounds, [2, 1, 0, 3], 6) == [(0.0, 2), (0.5, 3), (1.0, 3), (math.inf, 6)]
    with pytest.raises(ValueError, match="4 bucket counts for 4 bounds: expected 5"):
        fixed_to_classic([0, 1, 2, 5], [1, 2, 3, 4], 10)


def test_names_are_seed_001s_with_the_prefix_rlpulse():
    assert names.prometheus_name("akka.optimize.training.rl.step.count") == "rlpulse_rl_step_count"
    assert names.prometheus_name("akka.optimize.training.gpu.clock.throttle_reasons") == "rlpulse_gpu_clock_throttle_reasons"
    assert names.prometheus_name("hw.gpu.memory.utilization") == "hw_gpu_memory_utilization"
    assert names.prometheus_name("akka.optimize.training.run.id") == names.RUN_ID == "rlpulse_run_id"
    assert names.prometheus_name("akka.optimize.training.rl.grader.failure.cause") == names.FAILURE_CAUSE
    assert names.prometheus_name("akka.optimize.training.job.rank") == names.JOB_RANK
    assert names.prometheus_name("akka.optimize.trainingx.y") == "akka_optimize_trainingx_y"  # a prefix of a word is not it
    assert names.prometheus_name("9-bad name") == "_9_bad_name"
    assert names.vllm_name("vllm:kv_cache_usage_perc") == "rlpulse_vllm_kv_cache_usage_perc"
    assert (names.RL_STEP_COUNT, names.JOB_PLACEMENT, names.CLIPPED_RATIO) == (
        "rlpulse_rl_step_count", "rlpulse_job_placement", "rlpulse_rl_step_completion_clipped_ratio")
    with pytest.raises(ValueError):
        names.prometheus_name(" ")
    with pytest.raises(ValueError, match="not a vLLM metric"):
        names.vllm_name("kv_cache_usage_perc")
