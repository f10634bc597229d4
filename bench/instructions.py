"""`make bench-instructions`: CPU instructions per request of the sidecar's paths, under callgrind.

Wall-clock benchmarks on a busy 2-core machine swing by ±15% between runs; instruction counts
do not (valgrind counts them whatever else runs). The sidecar runs alone under callgrind: the
real grpc.aio ext_proc server on the event loop `sluice serve` uses (SLUICE_EVENT_LOOP, uvloop
by default), every thread of it counted. A grpc.aio client in another process sends the messages
Envoy would and switches the counting on around its loop. The count over N requests is taken
twice (N_SMALL and N_LARGE) and differenced, which removes start-up, warm-up and shutdown. Paths:
  noop          the no-op processor (`sluice serve --noop`): request headers, body, response headers
  routing       Sluice's routing path on a one-candidate route, the cache off (as bench-overhead)
  exact_short   an exact cache hit, a one-line prompt (request headers, body -> immediate answer)
  exact_2k      an exact cache hit, bench-overhead's ~2 KB body
at concurrency 1 and 16 (16 streams interleaved). Prints a table, writes reports/instructions.json.
The user-space instructions only: the kernel's share (sockets) is the same for every path with
the same number of messages.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import time

from bench import report, sidecar_loop

N_SMALL, N_LARGE = 160, 480
PATHS = ("noop", "routing", "exact_short", "exact_2k")
CONCURRENCY = (1, 16)
SHORT_BODY = json.dumps({"model": "demo-model", "messages": [
    {"role": "user", "content": "How do I reset my password?"}]}).encode()
ANSWER = json.dumps({
    "id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "demo-model",
    "choices": [{"index": 0, "finish_reason": "stop",
                 "message": {"role": "assistant", "content": "Use the link on the sign-in page."}}],
    "usage": {"prompt_tokens": 9, "completion_tokens": 9, "total_tokens": 18}}).encode()


# --------------------------------------------------------------------- the measured process

def _messages(body: bytes):
    """What Envoy sends for one chat request on a one-candidate route (bench-overhead's)."""
    from envoy.config.core.v3 import base_pb2
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
    from google.protobuf import json_format, struct_pb2, text_format

    from devtools.envoy_config import chat_route

    metadata = base_pb2.Metadata()
    json_format.ParseDict(chat_route("bench", "/", [{"cluster": "upstream_a", "weight": 1}])["metadata"], metadata)
    headers = {":method": "POST", ":path": "/v1/chat/completions", ":authority": "127.0.0.1:10000",
               ":scheme": "http", "content-type": "application/json", "authorization": "Bearer bench",
               "user-agent": "wrk", "x-request-id": "req-1", "x-sluice-cluster": "upstream_a"}
    header_map = base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode())
                                             for k, v in headers.items()])
    first = pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=header_map))
    attributes = struct_pb2.Struct()
    attributes.update({"xds.route_name": "bench",
                       "xds.route_metadata": text_format.MessageToString(metadata, as_one_line=True)})
    first.attributes["envoy.filters.http.ext_proc"].CopyFrom(attributes)
    response_headers = base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=":status", raw_value=b"200"),
                                                   base_pb2.HeaderValue(key="content-type", raw_value=b"application/json")])
    return [first,
            pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True)),
            pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=response_headers)),
            pb.ProcessingRequest(response_body=pb.HttpBody(body=ANSWER, end_of_stream=True))]


def _sidecar(path: str):
    from sidecar.observability.access_log import AccessLog
    from sidecar.service.app import build
    from sidecar.config import SidecarConfig
    from sidecar.extproc.noop import NoopProcessor
    from sidecar.extproc.processor import RequestProcessor
    from sidecar.pipeline import Pipeline
    from sidecar.pipeline.route_stage import RouteStage
    from sidecar.service.server import Sidecar
    from sidecar.observability.tracing import Tracing

    config = SidecarConfig(listen="127.0.0.1:0", cache=path.startswith("exact"), semantic=False)
    if path == "noop":   # as `sluice serve --noop`
        return None, Sidecar(config, Pipeline(RouteStage(scrape_interval_s=None)), NoopProcessor)
    app = build(config)
    access_log = AccessLog(write=lambda line: None)     # built and encoded, not written
    return app, Sidecar(config, app.pipeline, RequestProcessor, access_log=access_log,
                        tracing=Tracing.from_config(config))


async def _serve(path: str, port_file: str) -> None:
    """The measured process: the sidecar alone, until SIGTERM."""
    import gc
    import signal

    app, sidecar = _sidecar(path)
    if app is not None:
        await app.start()
    await sidecar.start()
    gc.collect()
    gc.freeze()                                           # as sidecar.service.server.serve does
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    pathlib.Path(port_file).write_text(str(sidecar.port))
    await stop.wait()
    await sidecar.server.stop(0)
    if app is not None:
        await app.close()


async def _drive(path: str, port: int, server_pid: int, requests: int, concurrency: int) -> None:
    """Envoy's part, in its own process: warm up, then count the sidecar over `requests`."""
    import grpc
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

    from bench.overhead import chat_body

    messages = _messages(chat_body() if path in ("routing", "exact_2k", "noop") else SHORT_BODY)
    hit = path.startswith("exact")
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.ExternalProcessorStub(channel)

        async def one(sent) -> None:
            call = stub.Process()
            for message in sent:
                await call.write(message)
                reply = await call.read()
                if reply.HasField("immediate_response"):
                    break
            await call.done_writing()

        async def some(count: int) -> None:
            for _ in range(count):
                await one(messages[:2] if hit else messages[:3])

        if hit:
            await one(messages)                           # a miss whose answer is stored
            await asyncio.sleep(0.2)
        await asyncio.gather(*(some(50 // concurrency) for _ in range(concurrency)))   # warm-up
        _callgrind(server_pid, "on")
        await asyncio.gather(*(some(requests // concurrency) for _ in range(concurrency)))
        _callgrind(server_pid, "off")


def _callgrind(pid: int, state: str) -> None:
    subprocess.run(["callgrind_control", "-i", state, str(pid)], capture_output=True, check=True)


# --------------------------------------------------------------------- the driver

def _instructions(path: str, requests: int, concurrency: int) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        port_file = pathlib.Path(tmp) / "port"
        log_file = pathlib.Path(tmp) / "callgrind.log"
        sidecar_log = pathlib.Path(tmp) / "sidecar.log"       # a file: a pipe nobody reads can fill
        with sidecar_log.open("w") as errors:
            server = subprocess.Popen(
                ["valgrind", "--tool=callgrind", "--instr-atstart=no", "--callgrind-out-file=/dev/null",
                 f"--log-file={log_file}", sys.executable, "-m", "bench.instructions", "--serve", path,
                 str(port_file)], cwd=report.ROOT, stdout=subprocess.DEVNULL, stderr=errors)
        try:
            deadline = time.monotonic() + 300                 # the model-free sidecar starts in ~30 s under valgrind
            while not (port_file.exists() and port_file.read_text()):
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the sidecar under callgrind did not start:\n{sidecar_log.read_text()[-3000:]}")
                time.sleep(0.2)
            subprocess.run([sys.executable, "-m", "bench.instructions", "--drive", path, port_file.read_text(),
                            str(server.pid), str(requests), str(concurrency)], cwd=report.ROOT, check=True, timeout=900)
            server.terminate()
            server.wait(timeout=120)
        finally:
            if server.poll() is None:
                server.kill()
                server.wait()
        match = re.search(r"Collected : (\d+)", log_file.read_text())
    if server.returncode != 0 or match is None:
        raise RuntimeError(f"callgrind run of {path} failed (exit {server.returncode})")
    return int(match.group(1))


def per_request(path: str, concurrency: int) -> float:
    return (_instructions(path, N_LARGE, concurrency) - _instructions(path, N_SMALL, concurrency)) / (N_LARGE - N_SMALL)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--serve", nargs=2, metavar=("PATH", "PORT_FILE"), help=argparse.SUPPRESS)
    parser.add_argument("--drive", nargs=5, metavar=("PATH", "PORT", "PID", "REQUESTS", "CONCURRENCY"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        sidecar_loop.run(_serve(*args.serve))
        return 0
    if args.drive:
        path, *numbers = args.drive
        asyncio.run(_drive(path, *map(int, numbers)))
        return 0
    if shutil.which("valgrind") is None:
        print("valgrind is needed (apt-get install valgrind)", file=sys.stderr)
        return 1
    results = {c: {path: per_request(path, c) for path in PATHS} for c in CONCURRENCY}
    rows = [{"path": path, "concurrency": c, "instructions/request": round(counts[path]),
             "vs noop": counts[path] / counts["noop"]}
            for c, counts in results.items() for path in PATHS]
    print(f"callgrind, user-space instructions per request of the sidecar process ({sidecar_loop.name()} loop), "
          f"{N_LARGE - N_SMALL} requests differenced")
    print(report.table(rows, ["path", "concurrency", "instructions/request", "vs noop"]))
    written = report.write("instructions", {"requests": N_LARGE - N_SMALL, "event_loop": sidecar_loop.name(),
                                            "per_request": {str(c): v for c, v in results.items()}})
    print(f"wrote {written}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
