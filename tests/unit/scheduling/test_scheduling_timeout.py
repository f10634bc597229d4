import pytest

from sidecar.scheduling.model import ClusterSnapshot
from sidecar.scheduling.timeout import TimeoutConfig, model_size_b, upstream_timeout_ms

CONFIG = TimeoutConfig(min_ms=5_000, max_ms=300_000)
OBSERVED = ClusterSnapshot("a", ttfb_p95_s=0.5, tokens_per_s=50.0)

TABLE = [
    # (why, prompt_tokens, max_tokens, model, signals, expected ms)
    ("seed: base", 0, None, "llama-3-8b", None, 30_000),
    ("seed: +15 s per 512 prompt tokens", 1024, None, "llama-3-8b", None, 60_000),
    ("seed: proportional within a block", 256, None, None, None, 37_500),
    ("seed: x2 for a 70b model", 512, None, "meta-llama/Llama-3.1-70B-Instruct", None, 90_000),
    ("seed: x2 for 405b", 0, None, "llama-3.1-405b", None, 60_000),
    ("seed: x2 for an 8x22b mixture", 0, None, "mixtral-8x22b", None, 60_000),
    ("seed: no x2 for a small model", 0, None, "qwen2.5-7b-instruct", None, 30_000),
    ("seed: clamped to max", 20_000, None, None, None, 300_000),
    ("seed without tokens/s observed", 0, 100, None, ClusterSnapshot("a", ttfb_p95_s=0.5), 30_000),
    ("observed: 2 x (TTFB P95 + max_tokens / tokens/s)", 0, 500, "llama-70b", OBSERVED, 21_000),
    ("observed: default max_tokens when unset", 0, None, None, OBSERVED, 41_960),
    ("observed: clamped to min", 0, 10, None, OBSERVED, 5_000),
    ("observed: clamped to max", 0, 100_000, None, OBSERVED, 300_000),
]


@pytest.mark.parametrize("prompt, max_tokens, model, signals, expected", [r[1:] for r in TABLE], ids=[r[0] for r in TABLE])
def test_timeout(prompt, max_tokens, model, signals, expected):
    assert upstream_timeout_ms(prompt, max_tokens, model, signals, CONFIG) == expected


@pytest.mark.parametrize(
    "name, size",
    [("llama-3.1-70b", 70), ("Qwen2.5-72B-Instruct", 72), ("mixtral-8x7b", 56), ("phi-3-mini-4k", None),
     ("gpt-4o", None), (None, None), ("llama-3-8b-32k", 8), ("qwen1.5-0.5b", 0.5)],
)
def test_model_size_from_name(name, size):
    assert model_size_b(name) == size


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(min_ms=0), "TimeoutConfig.min_ms must be an integer >= 1"),
        (dict(min_ms=10_000, max_ms=5_000), r"TimeoutConfig.max_ms must be >= min_ms \(10000\)"),
        (dict(safety_factor=0.5), "TimeoutConfig.safety_factor must be >= 1"),
        (dict(base_s=-1), "TimeoutConfig.base_s must be > 0"),
        (dict(default_max_tokens=0), "TimeoutConfig.default_max_tokens must be an integer >= 1"),
    ],
)
def test_bad_config_names_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TimeoutConfig(**kwargs)
