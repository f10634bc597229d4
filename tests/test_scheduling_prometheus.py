import random

import pytest

from sidecar.scheduling.model import UpstreamLoad
from sidecar.scheduling.prometheus_text import parse_samples, upstream_load

VLLM = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="llama-70b"} 3.0
vllm:num_requests_running{engine="1",model_name="llama-70b"} 5.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="llama-70b"} 1.0
vllm:num_requests_waiting{engine="1",model_name="llama-70b"} 2.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="llama-70b"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="llama-70b"} 0.75
vllm:prompt_tokens_total{engine="0",model_name="llama-70b"} 1234
"""


def test_vllm_metrics_are_summed_over_engines_and_kv_usage_averaged():
    assert upstream_load(VLLM) == UpstreamLoad(waiting=3.0, running=8.0, kv_cache_usage=0.5)


def test_bytes_are_accepted():
    assert upstream_load(VLLM.encode()) == upstream_load(VLLM)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("vllm:num_requests_waiting 4", UpstreamLoad(waiting=4.0)),
        ("vllm:gpu_cache_usage_perc 0.9", UpstreamLoad(kv_cache_usage=0.9)),  # before vLLM V1
        ("vllm:kv_cache_usage_perc 0.1\nvllm:gpu_cache_usage_perc 0.9", UpstreamLoad(kv_cache_usage=0.1)),
        ("vllm:num_requests_running{} 2 1712345678000", UpstreamLoad(running=2.0)),  # timestamp
        ('vllm:num_requests_running{a="x",} 2', UpstreamLoad(running=2.0)),  # trailing comma
        ('vllm:num_requests_running{a="x\\"} 9",b="{"} 2', UpstreamLoad(running=2.0)),  # quoted braces
        ("vllm:num_requests_waiting NaN\nvllm:num_requests_running 1", UpstreamLoad(running=1.0)),
        ("vllm:num_requests_waiting +Inf\nvllm:num_requests_running 1", UpstreamLoad(running=1.0)),
        ("process_cpu_seconds_total 12\n# EOF", None),  # nothing of vLLM's
        ("", None),
    ],
)
def test_upstream_load_table(text, expected):
    assert upstream_load(text) == expected


GARBAGE = [
    "garbage",
    "vllm:num_requests_waiting",
    "vllm:num_requests_waiting{",
    'vllm:num_requests_waiting{a="b} 3',
    "vllm:num_requests_waiting{a=b} 3",
    "vllm:num_requests_waiting abc",
    "vllm:num_requests_waiting 1 2 3",
    "vllm:num_requests_waiting3",
    "{} 3",
    "\x00\x01\x02",
    b"\xff\xfe\xfd",
    "<html><body>502 Bad Gateway</body></html>",
    None,
    12,
]


@pytest.mark.parametrize("text", GARBAGE)
def test_garbage_gives_nothing_and_never_raises(text):
    assert upstream_load(text) is None


def test_good_lines_survive_among_garbage():
    text = "\n".join(g for g in GARBAGE if isinstance(g, str)) + "\nvllm:num_requests_waiting 7\n"
    assert upstream_load(text) == UpstreamLoad(waiting=7.0)


def test_random_bytes_never_raise():
    rng = random.Random(7)
    for _ in range(200):
        blob = bytes(rng.randrange(256) for _ in range(rng.randrange(200)))
        upstream_load(blob)
        upstream_load(VLLM[: rng.randrange(len(VLLM))] + blob.decode("latin-1"))


def test_labels_are_parsed_with_escapes():
    [sample] = parse_samples('m{a="q\\"uote",b="line\\nbreak",c="back\\\\slash"} 1.5')
    assert sample.labels == {"a": 'q"uote', "b": "line\nbreak", "c": "back\\slash"}
    assert sample.value == 1.5
