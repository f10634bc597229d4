"""Start Envoy, the Sluice sidecar and two demo upstreams on loopback; stop them all.

`make run` uses it with the default ports; end-to-end tests and benchmarks use it with free
ports and their own Envoy variants. Envoy is started from this (living) process: an Envoy
whose parent shell exits is sent SIGTERM (../shared/ENVOY_NOTES.md).
"""
from __future__ import annotations

import argparse
import os
import pathlib
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field

from devtools import envoy_config

ROOT = pathlib.Path(__file__).resolve().parent.parent
BIN = pathlib.Path(sys.executable).parent


_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A port nothing listens on, never handed out before by this process, and below Linux's
    ephemeral range (32768-60999): a port from bind(0) is in that range, where any outgoing
    connection may take it as its local port before our server binds it (seen: Envoy failing
    with "address already in use" in a full test run)."""
    for _ in range(1000):
        port = random.randint(20000, 32000)
        if port in _HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    raise OSError("no free port in 20000-32000")


def http_get(url: str, timeout: float = 1.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")


def wait_until(check, what: str, timeout: float = 30.0, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what}: process exited with {proc.returncode}")
        try:
            if check():
                return
        except OSError:
            pass
        time.sleep(0.05)
    raise TimeoutError(f"{what} not ready after {timeout}s")


def ensure_certificate(directory: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path]:
    """A self-signed certificate for 127.0.0.1/localhost (made once)."""
    cert, key = directory / "cert.pem", directory / "key.pem"
    if not cert.exists() or not key.exists():
        directory.mkdir(parents=True, exist_ok=True)
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key),
                        "-out", str(cert), "-days", "365", "-subj", "/CN=localhost",
                        "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
                       check=True, capture_output=True)
    return cert, key


@dataclass
class Ports:
    http: int = field(default_factory=free_port)
    https: int = field(default_factory=free_port)
    admin: int = field(default_factory=free_port)
    sidecar: int = field(default_factory=free_port)
    metrics: int = field(default_factory=free_port)
    upstream_a: int = field(default_factory=free_port)
    upstream_b: int = field(default_factory=free_port)

    @classmethod
    def defaults(cls) -> "Ports":
        return cls(http=10000, https=10443, admin=9901, sidecar=50051, metrics=9464,
                   upstream_a=8001, upstream_b=8002)


# Settings a stack never takes from the shell that starts it: a developer's REDIS_URL would
# point `make run` or the tests at a real Redis (and write into it). A stack that wants one
# says so (sidecar_env).
NOT_INHERITED = ("REDIS_URL", "SLUICE_REDIS_URL", "SLUICE_CACHE_SECRET", "SLUICE_CONFIG_FILE")


def inherited_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in NOT_INHERITED}


@dataclass
class Stack:
    workdir: pathlib.Path
    ports: Ports = field(default_factory=Ports)
    envoy_vars: dict = field(default_factory=dict)    # template variables (envoy_config.DEFAULTS)
    routes: list | None = None                         # replaces the template's routes
    upstream_args: dict = field(default_factory=dict)  # name -> extra demo-upstream flags
    sidecar_args: list = field(default_factory=list)
    sidecar_env: dict = field(default_factory=dict)
    extra_upstreams: tuple = ()                        # more demo upstreams: "c" -> cluster upstream_c
    sidecars: int = 1                                  # replicas behind Envoy: "sidecar", "sidecar2", ...
    with_sidecar: bool = True
    procs: dict = field(default_factory=dict)
    extra_ports: dict = field(default_factory=dict)

    def upstream_port(self, name: str) -> int:
        if name in ("a", "b"):
            return getattr(self.ports, f"upstream_{name}")
        return self.extra_ports.setdefault(name, free_port())

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.ports.http}/v1"

    # --- processes --------------------------------------------------------------------------

    def _spawn(self, name: str, cmd: list[str], env: dict | None = None) -> subprocess.Popen:
        self.workdir.mkdir(parents=True, exist_ok=True)
        logfile = open(self.workdir / f"{name}.log", "ab")
        proc = subprocess.Popen(cmd, stdout=logfile, stderr=subprocess.STDOUT, cwd=ROOT,
                                env={**inherited_env(), "PYTHONUNBUFFERED": "1", **(env or {})})
        logfile.close()
        self.procs[name] = proc
        return proc

    def start_upstream(self, name: str) -> None:
        port = self.upstream_port(name)
        proc = self._spawn(f"upstream_{name}", [
            str(BIN / "python"), "-m", "devtools.demo_upstream", "--port", str(port), "--name", name,
            *self.upstream_args.get(name, [])])
        wait_until(lambda: http_get(f"http://127.0.0.1:{port}/health")[0] == 200,
                   f"demo upstream {name}", proc=proc)

    def sidecar_names(self) -> list[str]:
        return ["sidecar"] + [f"sidecar{i}" for i in range(2, self.sidecars + 1)]

    def sidecar_ports(self, name: str = "sidecar") -> tuple[int, int]:
        """(gRPC port, metrics port) of a sidecar replica."""
        if name == "sidecar":
            return self.ports.sidecar, self.ports.metrics
        return self.extra_ports.setdefault(name, free_port()), self.extra_ports.setdefault(name + "_metrics", free_port())

    def start_sidecar(self, name: str = "sidecar") -> None:
        grpc_port, metrics_port = self.sidecar_ports(name)
        proc = self._spawn(name, [
            str(BIN / "sluice"), "serve", "--listen", f"127.0.0.1:{grpc_port}",
            "--metrics-listen", f"127.0.0.1:{metrics_port}", *self.sidecar_args],
            env=self.sidecar_env)
        wait_until(lambda: http_get(f"http://127.0.0.1:{metrics_port}/metrics")[0] == 200,
                   name, timeout=60, proc=proc)

    def stop_process(self, name: str, sig: int = signal.SIGTERM, timeout: float = 15.0) -> int | None:
        proc = self.procs.pop(name, None)
        if proc is None or proc.poll() is not None:
            return None if proc is None else proc.returncode
        proc.send_signal(sig)
        try:
            return proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            return proc.wait()

    def stop_sidecar(self, name: str = "sidecar") -> None:
        self.stop_process(name)

    def write_envoy_config(self) -> pathlib.Path:
        cert, key = ensure_certificate(ROOT / "build" / "tls")
        config = envoy_config.render(**{
            "HTTP_PORT": self.ports.http, "HTTPS_PORT": self.ports.https,
            "ADMIN_PORT": self.ports.admin, "SIDECAR_PORT": self.ports.sidecar,
            "UPSTREAM_A_PORT": self.ports.upstream_a, "UPSTREAM_B_PORT": self.ports.upstream_b,
            "TLS_CERT": cert, "TLS_KEY": key, "HEALTH_CHECK_INTERVAL": "0.5s", **self.envoy_vars})
        if self.routes is not None:
            envoy_config.set_routes(config, self.routes)
        for name in self.extra_upstreams:
            envoy_config.add_cluster(config, f"upstream_{name}", self.upstream_port(name))
        for name in self.sidecar_names()[1:]:
            envoy_config.add_endpoint(config, "sluice_sidecar", self.sidecar_ports(name)[0])
        return envoy_config.write(config, self.workdir / "envoy.yaml")

    def start_envoy(self) -> None:
        path = self.write_envoy_config()
        proc = self._spawn("envoy", [
            str(BIN / "envoy"), "-c", str(path), "--concurrency", "1", "--log-level", "warn",
            "--base-id", str(self.ports.admin), "--drain-time-s", "1"])
        wait_until(lambda: http_get(f"http://127.0.0.1:{self.ports.admin}/ready")[0] == 200,
                   "envoy", proc=proc)
        if self.with_sidecar:
            for name in self.sidecar_names():
                self.wait_sidecar_health(True, name=name)

    def wait_sidecar_health(self, healthy: bool, timeout: float = 15.0, name: str = "sidecar") -> None:
        """Wait until Envoy's health check sees a sidecar replica as (un)healthy."""
        port = self.sidecar_ports(name)[0]

        def seen() -> bool:
            _, text = http_get(f"http://127.0.0.1:{self.ports.admin}/clusters")
            flags = [line for line in text.splitlines()
                     if line.startswith(f"sluice_sidecar::127.0.0.1:{port}::health_flags::")]
            return bool(flags) and (flags[0].endswith("::healthy") == healthy)
        wait_until(seen, f"sidecar {'healthy' if healthy else 'unhealthy'} in Envoy", timeout)

    def start(self) -> "Stack":
        try:
            for name in ("a", "b", *self.extra_upstreams):
                self.start_upstream(name)
            if self.with_sidecar:
                for name in self.sidecar_names():
                    self.start_sidecar(name)
            self.start_envoy()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for name in ("envoy", *self.sidecar_names(), *[n for n in list(self.procs) if n.startswith("upstream")]):
            self.stop_process(name)
        for name in list(self.procs):
            self.stop_process(name)

    def __enter__(self) -> "Stack":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


BANNER = """
Sluice is running (Envoy -> sidecar -> demo upstreams a and b). Logs: {workdir}

  OpenAI API     http://127.0.0.1:{http}/v1   and   https://127.0.0.1:{https}/v1 (cert: {cert})
  Envoy admin    http://127.0.0.1:{admin}/
  Metrics        http://127.0.0.1:{metrics}/metrics

Try:
  curl -s http://127.0.0.1:{http}/v1/chat/completions -H 'content-type: application/json' \\
       -H 'authorization: Bearer demo' \\
       -d '{{"model": "demo-model", "messages": [{{"role": "user", "content": "Hello!"}}]}}'

  {python} -c "import openai; c = openai.OpenAI(base_url='http://127.0.0.1:{http}/v1', api_key='demo'); \\
print(c.chat.completions.create(model='demo-model', messages=[{{'role': 'user', 'content': 'Hello!'}}]).choices[0].message.content)"

Ctrl-C stops everything.
"""


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def main() -> int:
    parser = argparse.ArgumentParser(description="Run Envoy + Sluice + demo upstreams on loopback.")
    parser.add_argument("--workdir", default=str(ROOT / "build" / "run"))
    args = parser.parse_args()
    stack = Stack(pathlib.Path(args.workdir), ports=Ports.defaults(),
                  upstream_args={"a": ["--ttft-ms", "80", "--tokens-per-s", "60", "--tokens", "40"],
                                 "b": ["--ttft-ms", "40", "--tokens-per-s", "120", "--tokens", "40"]})
    # Both explicitly: a shell starts a background job with SIGINT ignored, which Python keeps.
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)
    try:
        stack.start()
        p = stack.ports
        print(BANNER.format(workdir=stack.workdir, http=p.http, https=p.https, admin=p.admin,
                            metrics=p.metrics, cert=ROOT / "build" / "tls" / "cert.pem",
                            python=BIN / "python"), flush=True)
        while all(proc.poll() is None for proc in stack.procs.values()):
            time.sleep(0.5)
        dead = [name for name, proc in stack.procs.items() if proc.poll() is not None]
        print(f"stopping: {', '.join(dead)} exited (see {stack.workdir})", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\nstopping...", flush=True)
        return 0
    finally:
        stack.stop()


if __name__ == "__main__":
    sys.exit(main())
