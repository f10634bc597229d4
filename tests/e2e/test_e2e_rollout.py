"""Zero-downtime rollout: a sidecar replica replaced under load fails no request."""
import threading
import time

import httpx

from devtools.stack import http_get


def test_replacing_a_sidecar_under_load_fails_no_request(make_stack):
    stack = make_stack(sidecars=2, sidecar_args=["--drain-delay", "1.5", "--grace", "10"],
                       upstream_args={"a": ["--ttft-ms", "100", "--tokens", "4"],
                                      "b": ["--ttft-ms", "100", "--tokens", "4"]})
    url = f"http://127.0.0.1:{stack.ports.http}/v1/chat/completions"
    statuses, stop = [], threading.Event()

    def load(worker: int) -> None:
        with httpx.Client(timeout=30) as client:
            i = 0
            while not stop.is_set():
                body = {"model": "demo-model", "messages": [{"role": "user", "content": f"q{worker}-{i}"}]}
                statuses.append(client.post(url, json=body, headers={"authorization": "Bearer k"}).status_code)
                i += 1

    workers = [threading.Thread(target=load, args=(w,)) for w in range(4)]
    for w in workers:
        w.start()
    time.sleep(1.0)
    stack.stop_sidecar("sidecar")                 # SIGTERM: NOT_SERVING, drain, then exit
    stack.start_sidecar("sidecar")                # the replacement
    stack.wait_sidecar_health(True, name="sidecar")
    time.sleep(1.0)
    stop.set()
    for w in workers:
        w.join(30)
    assert len(statuses) > 20
    assert set(statuses) == {200}, {s: statuses.count(s) for s in set(statuses)}
    # No request fell back to fail-open: Envoy counts those.
    stats = http_get(f"http://127.0.0.1:{stack.ports.admin}/stats?filter=ext_proc")[1]
    counters = dict(line.split(": ") for line in stats.splitlines() if ": " in line)
    assert int(counters["http.sluice.ext_proc.streams_started"]) >= len(statuses)
    assert int(counters["http.sluice.ext_proc.failure_mode_allowed"]) == 0, counters
    assert int(counters["http.sluice.ext_proc.streams_failed"]) == 0, counters
