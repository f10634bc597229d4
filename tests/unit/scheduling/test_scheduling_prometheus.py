import asyncio
import random

import pytest

from sidecar.scheduling.model import UpstreamLoad
from sidecar.scheduling.prometheus_text import parse_samples, upstream_load
from sidecar.scheduling.scrape import MAX_BYTES, fetch

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
        ("vllm:num_requests_waiting -5\nvllm:num_requests_running 1", UpstreamLoad(running=1.0)),  # garbage
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


# -- the scraper's HTTP GET ------------------------------------------------------------------

async def _serve_in_pieces(pieces: list[bytes], keep_open: bool = False):
    """A metrics server that writes its answer in separate pieces, then closes (or not)."""
    async def answer(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        for piece in pieces:
            writer.write(piece)
            await writer.drain()
            await asyncio.sleep(0.02)           # each piece its own TCP segment
        if keep_open:
            await asyncio.sleep(30)
        writer.close()
    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/metrics"


async def test_fetch_reads_the_whole_answer_however_it_is_split():
    head = b"HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\n\r\n"
    server, url = await _serve_in_pieces([head, b"vllm:num_requests_waiting 1", b"2\n"])
    async with server:
        assert upstream_load(await fetch(url, timeout_s=5)) == UpstreamLoad(waiting=12.0)


async def test_fetch_stops_at_the_content_length_of_a_server_that_keeps_the_connection():
    body = b"vllm:num_requests_waiting 7\n"
    head = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body)
    server, url = await _serve_in_pieces([head, body], keep_open=True)
    async with server:
        assert upstream_load(await fetch(url, timeout_s=2)) == UpstreamLoad(waiting=7.0)


async def test_fetch_refuses_bad_urls_and_answers_over_the_cap_as_os_errors():
    for url in ("https://h/metrics", "http:///metrics", "http://h:99999/metrics"):
        with pytest.raises(OSError):
            await fetch(url, timeout_s=1)
    server, url = await _serve_in_pieces([b"HTTP/1.0 200 OK\r\n\r\n", b"#" * (MAX_BYTES + 10)])
    async with server:
        with pytest.raises(OSError, match="over"):
            await fetch(url, timeout_s=5)
