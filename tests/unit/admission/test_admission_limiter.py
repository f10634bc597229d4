import math

import pytest

from sidecar.admission.limiter import ConcurrencyLimiter, LimiterConfig

AIMD = LimiterConfig(algorithm="aimd", initial_limit=10, min_limit=2, max_limit=12, latency_target_s=1.0,
                     backoff_ratio=0.9, backoff_interval_s=1.0)
GRADIENT = LimiterConfig(initial_limit=10, min_limit=2, max_limit=40, warmup=1, smoothing=0.2, tolerance=1.5,
                         queue_size=4.0)
NO_ALLOWANCE = LimiterConfig(initial_limit=10, min_limit=2, max_limit=40, warmup=1, queue_size=0.0)


def fast(t=0.0, in_flight=10, waiting=None):
    return (0.5, True, in_flight, t, waiting)


def slow(t=0.0, latency=2.0):
    return (latency, True, 10, t, None)


def fail(t=0.0):
    return (None, False, 10, t, None)


def steady(latency, times, in_flight=10):
    return [(latency, True, in_flight, float(t), None) for t in times]


def run(config, samples):
    limiter = ConcurrencyLimiter(config)
    for latency, ok, in_flight, now, waiting in samples:
        limiter.on_sample(latency, ok, in_flight, now, upstream_waiting=waiting)
    return limiter


AIMD_TABLE = [
    ("a fast success while busy adds one", [fast()], 11),
    ("no growth while app-limited (in flight < limit / 2)", [fast(in_flight=4)], 10),
    ("growth stops at max_limit", [fast(t) for t in range(5)], 12),
    ("latency over target cuts by backoff_ratio", [slow()], 9),
    ("a failure cuts by backoff_ratio", [fail()], 9),
    ("a second cut within backoff_interval_s is skipped", [fail(0.0), fail(0.5), slow(0.9)], 9),
    ("cuts a backoff_interval_s apart both count", [fail(0.0), fail(1.0)], 8),  # 10 x 0.81 = 8.1
    ("cuts stop at min_limit", [fail(t) for t in range(30)], 2),
    ("the upstream's own queue stops growth", [fast(waiting=3)], 10),
    ("an empty upstream queue does not", [fast(waiting=0)], 11),
    ("a NaN latency on a success is ignored", [(math.nan, True, 10, 0.0, None)], 10),
    ("a negative latency on a success is ignored", [(-1.0, True, 10, 0.0, None)], 10),
]


@pytest.mark.parametrize("samples, expected", [row[1:] for row in AIMD_TABLE], ids=[row[0] for row in AIMD_TABLE])
def test_aimd(samples, expected):
    assert run(AIMD, samples).limit == expected


GRADIENT_TABLE = [
    # limit' = 0.8 limit + 0.2 (limit x gradient + queue_size); gradient = clamp(1.5 long / sample, 0.5, 1)
    ("steady latency grows by smoothing x queue_size a sample", GRADIENT, steady(1.0, range(2)), 11),  # 10.8, 11.6
    ("growth stops where in flight < limit / 2", GRADIENT, steady(1.0, range(50)), 20),
    ("latency within tolerance holds the limit without an allowance", NO_ALLOWANCE,
     steady(1.0, [0]) + steady(1.4, [1]), 10),
    ("a latency spike cuts, at most by half a step", NO_ALLOWANCE, steady(1.0, [0]) + steady(10.0, [1]), 9),  # 8 + 1
    ("no change while app-limited, even when slow", NO_ALLOWANCE, steady(1.0, [0]) + steady(10.0, [1], in_flight=4), 10),
    ("sustained tripled latency shrinks the limit despite the allowance", GRADIENT,
     steady(1.0, [0]) + steady(3.0, range(1, 6)), 9),
    ("a failure cuts by backoff_ratio", NO_ALLOWANCE, [fail()], 9),
    ("the upstream's own queue stops growth", GRADIENT, [(1.0, True, 10, 0.0, 5)], 10),
]


@pytest.mark.parametrize("config, samples, expected", [row[1:] for row in GRADIENT_TABLE],
                         ids=[row[0] for row in GRADIENT_TABLE])
def test_gradient(config, samples, expected):
    assert run(config, samples).limit == expected


def test_gradient_long_latency_catches_up_after_recovery():
    limiter = run(GRADIENT, steady(10.0, [0]) + steady(1.0, [1]))
    # EWMA step: 10 + (2 / 601) x (1 - 10) = 9.97; then long > 2 x sample cuts it by 5%
    assert limiter.long_latency_s == pytest.approx((10 + 2 / 601 * (1 - 10)) * 0.95)


def test_gradient_warmup_is_a_plain_mean():
    limiter = run(LimiterConfig(warmup=3), steady(1.0, [0]) + steady(2.0, [1]) + steady(3.0, [2]))
    assert limiter.long_latency_s == pytest.approx(2.0)


def test_on_sample_returns_the_new_limit():
    assert ConcurrencyLimiter(AIMD).on_sample(0.5, True, 10, 0.0) == 11


CONFIG_ERRORS = [
    ({"algorithm": "vegas"}, "LimiterConfig.algorithm"),
    ({"min_limit": 0}, "LimiterConfig.min_limit"),
    ({"min_limit": 5, "max_limit": 4, "initial_limit": 4}, "LimiterConfig.max_limit"),
    ({"initial_limit": 300}, "LimiterConfig.initial_limit"),
    ({"backoff_ratio": 1.0}, "LimiterConfig.backoff_ratio"),
    ({"backoff_ratio": 0}, "LimiterConfig.backoff_ratio"),
    ({"backoff_interval_s": -1}, "LimiterConfig.backoff_interval_s"),
    ({"smoothing": 1.5}, "LimiterConfig.smoothing"),
    ({"tolerance": 0.9}, "LimiterConfig.tolerance"),
    ({"queue_size": math.nan}, "LimiterConfig.queue_size"),
    ({"long_window": 0}, "LimiterConfig.long_window"),
    ({"latency_target_s": 0}, "LimiterConfig.latency_target_s"),
]


@pytest.mark.parametrize("kwargs, field", CONFIG_ERRORS, ids=[f for _, f in CONFIG_ERRORS])
def test_config_errors_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        LimiterConfig(**kwargs)
