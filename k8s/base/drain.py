"""preStop hooks of the Sluice gateway pod (standard library only; runs with the image's python3).

    drain.py envoy [--admin 127.0.0.1:9901] [--min-wait 15] [--max-wait 60]
        Envoy's hook. Starts a graceful drain of the traffic listeners (POST
        /drain_listeners?graceful&inboundonly: responses carry `Connection: close`, HTTP/2 gets
        GOAWAY, the listeners close after Envoy's --drain-time-s; the ops listener for probes and
        metrics stays), waits --min-wait seconds while the Service stops sending new connections,
        then until no request is in flight (http.sluice.downstream_rq_active == 0), at most
        --max-wait seconds in all. Then the kubelet sends SIGTERM and Envoy exits at once.

    drain.py after-envoy [--admin 127.0.0.1:9901] [--max-wait 65]
        The sidecar's hook. Waits until Envoy has exited (its admin port refuses connections), at
        most --max-wait seconds, so the sidecar keeps serving ext_proc for every request Envoy is
        still finishing. Then the kubelet sends SIGTERM: the sidecar reports NOT_SERVING for
        SLUICE_DRAIN_DELAY_S, then gives open streams SLUICE_GRACE_S.

The pod's terminationGracePeriodSeconds must exceed envoy --max-wait + SLUICE_DRAIN_DELAY_S +
SLUICE_GRACE_S (tests/deploy/test_manifests.py checks it). A hook never fails the shutdown: every error
ends the wait.
"""
from __future__ import annotations

import argparse
import sys
import time
import urllib.error
import urllib.request

ACTIVE_STAT = "http.sluice.downstream_rq_active"


def _admin(admin: str, path: str, method: str = "GET", timeout: float = 1.0) -> str:
    request = urllib.request.Request(f"http://{admin}{path}", method=method)
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return response.read().decode()


def active_requests(admin: str) -> int:
    text = _admin(admin, "/stats?filter=downstream_rq_active")
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name.strip() == ACTIVE_STAT:
            return int(value.strip())
    return 0


def drain_envoy(admin: str, min_wait: float, max_wait: float, poll: float = 0.5) -> str:
    started = time.monotonic()
    try:
        _admin(admin, "/drain_listeners?graceful&inboundonly", method="POST")
    except (OSError, urllib.error.URLError) as exc:
        return f"envoy admin unreachable ({exc}); nothing to drain"
    time.sleep(min(min_wait, max_wait))
    while True:
        try:
            active = active_requests(admin)
        except (OSError, urllib.error.URLError, ValueError) as exc:
            return f"envoy admin unreachable ({exc}); stopping the wait"
        waited = time.monotonic() - started
        if active == 0:
            return f"drained in {waited:.1f}s"
        if waited >= max_wait:
            return f"{active} requests still in flight after {waited:.1f}s; stopping anyway"
        time.sleep(poll)


def wait_for_envoy_exit(admin: str, max_wait: float, poll: float = 0.5) -> str:
    started = time.monotonic()
    while True:
        try:
            _admin(admin, "/ready")
        except urllib.error.HTTPError:
            pass  # Envoy answers (e.g. 503 while initialising): still running
        except (OSError, urllib.error.URLError):
            return f"envoy gone after {time.monotonic() - started:.1f}s"
        if time.monotonic() - started >= max_wait:
            return f"envoy still up after {max_wait:.0f}s; stopping anyway"
        time.sleep(poll)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=("envoy", "after-envoy"))
    parser.add_argument("--admin", default="127.0.0.1:9901", help="Envoy admin HOST:PORT")
    parser.add_argument("--min-wait", type=float, default=15.0)
    parser.add_argument("--max-wait", type=float, default=None)
    args = parser.parse_args(argv)
    if args.mode == "envoy":
        message = drain_envoy(args.admin, args.min_wait, 60.0 if args.max_wait is None else args.max_wait)
    else:
        message = wait_for_envoy_exit(args.admin, 65.0 if args.max_wait is None else args.max_wait)
    print(f"sluice preStop {args.mode}: {message}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
