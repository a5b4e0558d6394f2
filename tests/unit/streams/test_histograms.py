import json
import math
import random

import pytest

from rlpulse.streams.histograms import REWARD_BOUNDS, ExpHistogram, RewardHistogram, exp_index, reward_bucket


@pytest.mark.parametrize("x, bucket", [
    (0, 0), (-0.5, 0), (0.05, 1), (0.1, 1), (0.1 + 0.2, 4), (0.3, 3), (0.99, 10),
    (0.995, 11), (1.0, 11), (1.5, 12), (2, 12), (5, 13), (5.0001, 14),
])
def test_reward_bucket_edges(x, bucket):
    assert reward_bucket(x) == bucket


def test_reward_bounds_shape_and_exact_comparisons_as_in_opentelemetry():
    assert len(REWARD_BOUNDS) == 14
    assert 0.1 + 0.2 == 0.30000000000000004  # above the bound 0.3: (0.3, 0.4], as OpenTelemetry puts it
    assert reward_bucket(0.1 + 0.2) == 4
    assert reward_bucket(1e-10) == 1  # above 0: not a zero reward
    assert reward_bucket(0.3) == 3 and reward_bucket(0.30000000000000004) == 4


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_reward_bucket_rejects_non_finite(bad):
    with pytest.raises(ValueError, match=repr(bad)):
        reward_bucket(bad)
    with pytest.raises(ValueError):
        RewardHistogram().add(bad)


def rewards(values):
    h = RewardHistogram()
    for v in values:
        h.add(v)
    return h


def test_reward_histogram_add():
    h = rewards([0, -0.5, 0.25, 1.0, 2.5])
    assert h.counts == [2, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 1, 0, 1, 0]
    assert (h.count, h.sum, h.min, h.max, h.zeros) == (5, 3.25, -0.5, 2.5, 2)
    assert h.zero_fraction == 0.4
    assert h.mean == 0.65


def test_reward_histogram_empty():
    h = RewardHistogram()
    assert h.counts == [0] * 15
    assert (h.count, h.sum, h.min, h.max, h.zeros) == (0, 0.0, None, None, 0)
    assert h.zero_fraction == 0.0 and h.mean == 0.0


def test_reward_histogram_merge_is_commutative_and_equals_adding_all():
    a_values, b_values = [0, 0.5, 1.0, 7.0], [-0.25, 0.125, 0.99]
    a, b = rewards(a_values), rewards(b_values)
    merged = a.merge(b)
    assert merged == b.merge(a) == rewards(a_values + b_values)
    assert (merged.min, merged.max, merged.zeros, merged.count) == (-0.25, 7.0, 2, 7)
    assert a == rewards(a_values)  # merge returns a new object
    assert a.merge(RewardHistogram()) == a and RewardHistogram().merge(a) == a


def test_reward_histogram_dict_round_trip():
    for h in (rewards([0, 0.3, 0.995, 6]), RewardHistogram()):
        d = json.loads(json.dumps(h.to_dict()))
        assert RewardHistogram.from_dict(d) == h
    with pytest.raises(ValueError):
        RewardHistogram.from_dict({**RewardHistogram().to_dict(), "counts": [0] * 14})


# Scale 0: base 2, bucket i is (2**i, 2**(i+1)]; 1 = 2**0 tops bucket -1, 4 = 2**2 tops bucket 1.
@pytest.mark.parametrize("v, index", [(1, -1), (2, 0), (3, 1), (4, 1), (5, 2), (0.5, -2), (0.75, -1)])
def test_exp_index_scale_0(v, index):
    assert exp_index(v, 0) == index


# Scale 1: base sqrt(2), bucket i is (2**(i/2), 2**((i+1)/2)]. 3 lies in (2**1.5 = 2.83, 4];
# 5 in (4, 2**2.5 = 5.66]; 1.5 in (1.41, 2].
@pytest.mark.parametrize("v, index", [(1, -1), (2, 1), (3, 3), (4, 3), (5, 4), (1.5, 1), (1.4, 0)])
def test_exp_index_scale_1(v, index):
    assert exp_index(v, 1) == index


# Scale -1: base 4, bucket i is (4**i, 4**(i+1)].
@pytest.mark.parametrize("v, index", [(1, -1), (2, 0), (4, 0), (5, 1), (16, 1), (17, 2)])
def test_exp_index_scale_minus_1(v, index):
    assert exp_index(v, -1) == index


def test_exp_index_scale_20():
    # Exact powers of two 2**e top bucket (e << 20) - 1.
    assert exp_index(1, 20) == -1
    assert exp_index(2, 20) == 2**20 - 1 == 1048575
    assert exp_index(1024, 20) == (10 << 20) - 1 == 10485759
    assert exp_index(0.5, 20) == -(2**20) - 1 == -1048577
    # 3: log2(3) * 2**20 = 1661953.34..., so ceil - 1 = 1661953.
    assert exp_index(3, 20) == 1661953
    assert 2 ** (1661953 / 2**20) < 3 < 2 ** (1661954 / 2**20)
    # One ulp either side of a power of two stays on its side of that power.
    assert exp_index(math.nextafter(4.0, 0), 20) == (2 << 20) - 1
    assert exp_index(math.nextafter(4.0, 8), 20) == 2 << 20


def lengths(values, **kwargs):
    h = ExpHistogram(**kwargs)
    for v in values:
        h.add(v)
    return h


def test_exp_histogram_zero_count_and_stats():
    h = lengths([0, 0, 3, 5])
    assert (h.zero_count, h.count, h.sum, h.min, h.max) == (2, 4, 8.0, 0.0, 5.0)
    # log2(3) * 2**s and log2(5) * 2**s: 202.9 and 297.2 at scale 7 (96 buckets), 405.8 and
    # 594.4 at scale 8 (190 > 160), so the histogram settles at scale 7.
    assert (h.scale, h.offset, len(h.counts)) == (7, 202, 96)
    assert h.counts[0] == 1 and h.counts[-1] == 1 and sum(h.counts) == 2  # trimmed at both ends
    empty = ExpHistogram()
    assert (empty.count, empty.min, empty.max, empty.counts) == (0, None, None, [])


@pytest.mark.parametrize("bad", [-1, math.nan, math.inf])
def test_exp_histogram_rejects_negative_and_non_finite(bad):
    with pytest.raises(ValueError):
        ExpHistogram().add(bad)


def test_exp_histogram_downscales_to_fit():
    # At scale s, 1 sits in bucket -1 and 2**40 in (40 << s) - 1: 42 * 2**20 buckets apart at
    # scale 20. Scale 1 spans -1..79 (81 buckets); scale 2 would span -1..159 (161 > 160).
    h = lengths([1, 2**40])
    assert (h.scale, h.offset, len(h.counts)) == (1, -1, 81)
    assert h.counts[0] == 1 and h.counts[-1] == 1 and sum(h.counts) == 2
    assert h.count == 2 and h.min == 1 and h.max == 2**40


def test_exp_histogram_downscale_does_not_depend_on_order():
    values = [1, 3, 7, 100, 1000, 2**40, 0, 17]
    assert lengths(values) == lengths(list(reversed(values))) == lengths(sorted(values))


def test_exp_histogram_merge_across_scales_equals_adding_all():
    a_values = [1, 3, 7, 100, 1000]
    b_values = [0, 2, 5, 2**20, 123456789]
    a, b = lengths(a_values), lengths(b_values)
    # 1000 needs index 159 at scale 4 (span 161), so a sits at 3; b spans 2**27 and sits at 2.
    assert (a.scale, b.scale) == (3, 2)
    merged = a.merge(b)
    whole = lengths(a_values + b_values)
    assert merged == b.merge(a) == whole
    assert (merged.scale, merged.offset, merged.counts) == (whole.scale, whole.offset, whole.counts)
    assert merged.zero_count == 1 and merged.count == 10
    assert a == lengths(a_values)  # merge returns a new object


def test_exp_histogram_merge_needs_further_downscale():
    # Each side fits at scale 2 on its own; together they span 1..2**60 and must go lower.
    a, b = lengths([1, 2**30]), lengths([2**30, 2**60])
    merged = a.merge(b)
    assert merged == lengths([1, 2**30, 2**30, 2**60])
    assert merged.scale < min(a.scale, b.scale)


def test_exp_histogram_merge_random_chunks():
    rng = random.Random(7)
    values = [rng.choice([0, rng.randint(1, 64), rng.randint(1, 32768)]) for _ in range(600)]
    parts = [lengths(values[i:i + 100]) for i in range(0, 600, 100)]
    merged = ExpHistogram()
    for part in parts:
        merged = merged.merge(part)
    assert merged == lengths(values)


def test_exp_histogram_merge_with_empty():
    a = lengths([5, 9])
    assert a.merge(ExpHistogram()) == a == ExpHistogram().merge(a)
    assert ExpHistogram().merge(ExpHistogram()) == ExpHistogram()


def test_exp_histogram_quantile():
    h = lengths(range(1, 101))
    assert h.scale == 4  # 100 needs index 106 at scale 4; scale 5 would need 212
    assert h.quantile(0) == 1 and h.quantile(1) == 100
    base = 2 ** (2**-h.scale)
    # Rank 50 is the value 50; the bucket's geometric midpoint is within sqrt(base) of it.
    assert abs(math.log(h.quantile(0.5) / 50)) <= math.log(base) / 2
    assert lengths([0, 0, 0, 10]).quantile(0.5) == 0.0
    with pytest.raises(ValueError):
        ExpHistogram().quantile(0.5)
    with pytest.raises(ValueError):
        h.quantile(1.5)


def test_exp_histogram_dict_round_trip():
    for h in (lengths([0, 1, 3, 2**40, 77]), ExpHistogram()):
        d = json.loads(json.dumps(h.to_dict()))
        assert ExpHistogram.from_dict(d) == h


@pytest.mark.full
@pytest.mark.parametrize("seed", range(10))
def test_exp_histogram_quantiles_in_one_pass_are_each_quantile(seed):
    import random
    rng = random.Random(seed)
    for _ in range(200):
        h = ExpHistogram(max_size=rng.choice([4, 160]))
        values = [rng.choice([0.0, rng.uniform(1e-3, 10), rng.lognormvariate(0, 3)]) for _ in range(rng.randrange(1, 60))]
        h.add_many(values)
        qs = tuple(sorted(rng.uniform(0, 1) for _ in range(rng.randrange(1, 5)))) + (0.5, 0.9, 0.99)
        qs = tuple(sorted(qs))
        assert h.quantiles(qs) == [h.quantile(q) for q in qs]
    with pytest.raises(ValueError, match="empty"):
        ExpHistogram().quantiles((0.5,))
    with pytest.raises(ValueError, match="within"):
        h.quantiles((0.5, 1.5))
