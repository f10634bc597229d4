"""Decode/encode cost of ext_proc messages: xds-protos (upb) vs envoy-data-plane (betterproto2).

Run: `make bench-decode` (= `.venv/bin/python -m bench.decode`).

xds-protos is measured in this process. envoy-data-plane is measured in a subprocess of its
own venv, `build/edp-venv` (created on first run with pip, reused after), because its
dependency set (betterproto2, pydantic, grpclib) is not one we install into the project venv.
The parent serializes the request messages with xds-protos and hands the bytes over in a temp
file; the child parses exactly the same bytes. Both sides also "use" what they decoded (the
same field walk), and the results are compared, so a row is only printed for a decode that
read the same data. The child's encoded response is parsed back with xds-protos and must
equal ours.

Workload (what Envoy sends the sidecar for one chat completion):
  body     ProcessingRequest.request_body: ~2 KB OpenAI chat JSON, end_of_stream=true, plus
           attributes["envoy.filters.http.ext_proc"] carrying "xds.route_metadata" as a Struct
           (filter_metadata.sluice = {name, candidates[{cluster, weight}]}).
  headers  ProcessingRequest.request_headers: 15 typical headers, HeaderValue.raw_value bytes.
  response ProcessingResponse.request_body.response: CommonResponse with a header mutation
           setting 2 headers (raw_value, OVERWRITE_IF_EXISTS_OR_ADD) and clear_route_cache.

Ops (median µs per op over REPEAT timeit runs, gc enabled as in a live server):
  decode_*      FromString / betterproto2 parse of the bytes.
  decode_use_*  decode, then read what the sidecar reads (body bytes, route metadata, headers).
                upb builds Python objects lazily on access, so this is the fair comparison.
  encode_response     build the response message and serialize it.
  serialize_response  serialize an already built response.

This module imports only the standard library at the top: the same file runs as the child
(`python bench/decode.py --edp-worker IN OUT`) in the edp venv, which has no xds-protos.
"""
from __future__ import annotations

import argparse
import base64
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import timeit
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EDP_VENV = ROOT / "build" / "edp-venv"
EDP_PINS = ["envoy-data-plane==2.2.0", "betterproto2[all]==0.9.1"]
REPORT = ROOT / "reports" / "decode.json"

REPEAT = 7          # timeit runs per op; each run lasts >= 0.2 s (Timer.autorange)
WORKER_TIMEOUT_S = 150

EXT_PROC_NS = "envoy.filters.http.ext_proc"   # key Envoy uses in ProcessingRequest.attributes
ROUTE_METADATA_ATTR = "xds.route_metadata"
ROUTE_METADATA = {
    "filter_metadata": {
        "sluice": {
            "name": "chat-completions",
            "candidates": [
                {"cluster": "openai-gpt4o-mini", "weight": 3.0},
                {"cluster": "vllm-llama3-8b", "weight": 1.0},
            ],
        }
    }
}

REQUEST_HEADERS = [
    (":authority", "llm-gateway.internal.example.com"),
    (":path", "/v1/chat/completions"),
    (":method", "POST"),
    (":scheme", "https"),
    ("content-type", "application/json"),
    ("content-length", "2048"),
    ("authorization", "Bearer sk-proj-4f9c2a7e1b8d4c3f9a6e5d2b1c0f8e7a6d5c4b3a2f1e0d9c"),
    ("user-agent", "OpenAI/Python 1.54.3"),
    ("accept", "application/json"),
    ("accept-encoding", "gzip, deflate"),
    ("x-stainless-lang", "python"),
    ("x-stainless-package-version", "1.54.3"),
    ("x-stainless-runtime-version", "3.11.7"),
    ("x-forwarded-proto", "https"),
    ("x-request-id", "0b6f1c9e-3a52-4d8e-9f7a-2c4e6b8d1a3f"),
]
RESPONSE_HEADERS = [
    ("x-sluice-cluster", "vllm-llama3-8b"),
    ("x-sluice-route", "chat-completions"),
]
APPEND_ACTION_OVERWRITE = 2   # HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
BODY_TARGET_BYTES = 2048


def chat_body() -> bytes:
    """A deterministic OpenAI chat-completions request body of about BODY_TARGET_BYTES."""
    doc = {
        "model": "gpt-4o-mini",
        "messages": [
            {"role": "system", "content": "You are a concise assistant for an internal "
             "support desk. Answer in plain English, cite ticket numbers when relevant."},
            {"role": "user", "content": "Our nightly export job failed again with exit code "
             "137 on the batch node. What does that usually mean?"},
            {"role": "assistant", "content": "Exit code 137 means the process was killed "
             "with SIGKILL, most often by the kernel OOM killer when the container exceeded "
             "its memory limit."},
            {"role": "user", "content": ""},
        ],
        "temperature": 0.2,
        "max_tokens": 512,
        "stream": False,
        "user": "ticket-48213",
    }
    filler = ("The job reads the whole orders table into memory before writing parquet "
              "files; the table grew by a third last month. How should I size it, and "
              "is there a way to stream the export instead? ")
    body = b""
    while len(body) < BODY_TARGET_BYTES:
        doc["messages"][-1]["content"] += filler
        body = json.dumps(doc, separators=(",", ":")).encode()
    over = len(body) - BODY_TARGET_BYTES
    doc["messages"][-1]["content"] = doc["messages"][-1]["content"][:-(over + 1)].rstrip() + "?"
    return json.dumps(doc, separators=(",", ":")).encode()


def per_op_us(fn) -> float:
    """Median µs per call of fn: autorange to >= 0.2 s a run, then REPEAT runs."""
    timer = timeit.Timer(fn, setup="import gc; gc.enable()")
    number, _ = timer.autorange()
    runs = timer.repeat(repeat=REPEAT, number=number)
    return statistics.median(runs) / number * 1e6


def run_ops(ops: dict) -> dict:
    return {name: round(per_op_us(fn), 2) for name, fn in ops.items()}


# ---------------------------------------------- shared by both libraries (same field names)


def build_response(ep, core, append_action):
    """The response to a body message: set 2 headers, clear the route cache.

    ep/core are the ext_proc and config.core modules of either library (same field names)."""
    common = ep.CommonResponse(
        header_mutation=ep.HeaderMutation(set_headers=[
            core.HeaderValueOption(header=core.HeaderValue(key=k, raw_value=v.encode()),
                                   append_action=append_action)
            for k, v in RESPONSE_HEADERS]),
        clear_route_cache=True)
    return ep.ProcessingResponse(request_body=ep.BodyResponse(response=common))


def use_body(msg) -> dict:
    """What the sidecar reads from a body message (either library: same field names)."""
    body = msg.request_body
    route = (msg.attributes[EXT_PROC_NS].fields[ROUTE_METADATA_ATTR].struct_value
             .fields["filter_metadata"].struct_value.fields["sluice"].struct_value.fields)
    cands = [(c.struct_value.fields["cluster"].string_value,
              c.struct_value.fields["weight"].number_value)
             for c in route["candidates"].list_value.values]
    return {"body_len": len(body.body), "eos": body.end_of_stream,
            "route": route["name"].string_value, "candidates": cands}


def use_headers(msg) -> dict:
    """What the sidecar reads from a headers message."""
    return {"headers": [(h.key, h.raw_value.decode("latin-1"))
                        for h in msg.request_headers.headers.headers],
            "eos": msg.request_headers.end_of_stream}


# --------------------------------------------------------------------------- xds-protos


def xds_messages():
    from envoy.config.core.v3 import base_pb2
    from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
    from google.protobuf import struct_pb2

    body_req = ep.ProcessingRequest()
    body_req.request_body.body = chat_body()
    body_req.request_body.end_of_stream = True
    attrs = struct_pb2.Struct()
    attrs.fields[ROUTE_METADATA_ATTR].struct_value.update(ROUTE_METADATA)
    body_req.attributes[EXT_PROC_NS].CopyFrom(attrs)

    hdr_req = ep.ProcessingRequest()
    for key, value in REQUEST_HEADERS:
        hdr_req.request_headers.headers.headers.add(key=key, raw_value=value.encode())
    hdr_req.request_headers.end_of_stream = False
    return ep, base_pb2, body_req, hdr_req


def xds_bench(body_bytes: bytes, hdr_bytes: bytes) -> tuple[dict, dict]:
    ep, base_pb2, _, _ = xds_messages()
    parse = ep.ProcessingRequest.FromString
    build = lambda: build_response(ep, base_pb2, APPEND_ACTION_OVERWRITE)  # noqa: E731
    resp = build()
    timings = run_ops({
        "decode_body": lambda: parse(body_bytes),
        "decode_headers": lambda: parse(hdr_bytes),
        "decode_use_body": lambda: use_body(parse(body_bytes)),
        "decode_use_headers": lambda: use_headers(parse(hdr_bytes)),
        "encode_response": lambda: build().SerializeToString(),
        "serialize_response": resp.SerializeToString,
    })
    check = {"body": use_body(parse(body_bytes)),
             "headers": use_headers(parse(hdr_bytes))}
    return timings, check


def xds_versions() -> dict:
    from importlib import metadata

    from google.protobuf.internal import api_implementation
    return {"xds-protos": metadata.version("xds-protos"),
            "protobuf": metadata.version("protobuf"),
            "protobuf_backend": api_implementation.Type(),
            "python": platform.python_version()}


# --------------------------------------------------------------------- envoy-data-plane
# Runs only inside build/edp-venv (the child process).


def edp_worker(in_path: str, out_path: str) -> None:
    from importlib import metadata

    from envoy_data_plane.envoy.config.core import v3 as core
    from envoy_data_plane.envoy.service.ext_proc import v3 as ep

    data = json.loads(Path(in_path).read_text())
    body_bytes = base64.b64decode(data["body"])
    hdr_bytes = base64.b64decode(data["headers"])
    parse = ep.ProcessingRequest.parse
    overwrite = core.HeaderValueOptionHeaderAppendAction(APPEND_ACTION_OVERWRITE)
    resp = build_response(ep, core, overwrite)
    timings = run_ops({
        "decode_body": lambda: parse(body_bytes),
        "decode_headers": lambda: parse(hdr_bytes),
        "decode_use_body": lambda: use_body(parse(body_bytes)),
        "decode_use_headers": lambda: use_headers(parse(hdr_bytes)),
        "encode_response": lambda: bytes(build_response(ep, core, overwrite)),
        "serialize_response": lambda: bytes(resp),
    })
    out = {
        "timings": timings,
        "check": {"body": use_body(parse(body_bytes)),
                  "headers": use_headers(parse(hdr_bytes))},
        "response": base64.b64encode(bytes(resp)).decode(),
        "versions": {name: metadata.version(name)
                     for name in ("envoy-data-plane", "betterproto2", "pydantic")}
        | {"python": platform.python_version()},
    }
    Path(out_path).write_text(json.dumps(out))


# ------------------------------------------------------------------------------ parent


def ensure_edp_venv() -> tuple[Path | None, str]:
    """Create or reuse build/edp-venv; returns (python, note) or (None, why not)."""
    python = EDP_VENV / "bin" / "python"
    stamp = EDP_VENV / ".installed"
    want = " ".join(EDP_PINS)
    if python.exists() and stamp.exists() and stamp.read_text().strip() == want:
        return python, f"reused {EDP_VENV.relative_to(ROOT)}"
    t0 = time.monotonic()
    try:
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(EDP_VENV)],
                       check=True, capture_output=True, text=True, timeout=120)
        pip = subprocess.run(
            [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check",
             *EDP_PINS], capture_output=True, text=True, timeout=600)
    except (subprocess.SubprocessError, OSError) as exc:
        return None, f"could not create {EDP_VENV}: {exc}"
    if pip.returncode != 0:
        tail = (pip.stderr or pip.stdout).strip().splitlines()[-3:]
        return None, f"pip install {want} failed (no network?): " + " | ".join(tail)
    stamp.write_text(want + "\n")
    return python, f"created {EDP_VENV.relative_to(ROOT)} in {time.monotonic() - t0:.0f} s"


def run_edp(python: Path, body_bytes: bytes, hdr_bytes: bytes) -> tuple[dict | None, str]:
    with tempfile.TemporaryDirectory(prefix="sluice-decode-") as tmp:
        in_path, out_path = Path(tmp) / "in.json", Path(tmp) / "out.json"
        in_path.write_text(json.dumps({"body": base64.b64encode(body_bytes).decode(),
                                       "headers": base64.b64encode(hdr_bytes).decode()}))
        try:
            proc = subprocess.run(
                [str(python), str(Path(__file__).resolve()), "--edp-worker",
                 str(in_path), str(out_path)],
                capture_output=True, text=True, timeout=WORKER_TIMEOUT_S, cwd=tmp)
        except subprocess.TimeoutExpired:
            return None, f"envoy-data-plane worker ran past {WORKER_TIMEOUT_S} s"
        if proc.returncode != 0 or not out_path.exists():
            return None, "envoy-data-plane worker failed: " + proc.stderr.strip()[-800:]
        return json.loads(out_path.read_text()), ""


def normalize(check: dict) -> dict:
    """JSON round trip, so tuples and lists compare equal across the process boundary."""
    return json.loads(json.dumps(check))


def print_table(xds: dict, edp: dict | None, ratio: dict | None, sizes: dict) -> None:
    print(f"\next_proc message cost, median µs per op ({REPEAT} timeit runs, gc on); "
          f"body msg {sizes['body']} B, headers msg {sizes['headers']} B, "
          f"response {sizes['response']} B")
    print(f"{'op':<22}{'xds-protos':>12}{'envoy-data-plane':>18}{'edp/xds':>10}")
    for op, us in xds.items():
        e = f"{edp[op]:.1f}" if edp else "-"
        r = f"{ratio[op]:.1f}x" if ratio else "-"
        print(f"{op:<22}{us:>12.2f}{e:>18}{r:>10}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--edp-worker", nargs=2, metavar=("IN", "OUT"), help=argparse.SUPPRESS)
    ap.add_argument("--skip-edp", action="store_true", help="measure xds-protos only")
    args = ap.parse_args(argv)
    if args.edp_worker:
        edp_worker(*args.edp_worker)
        return 0

    t0 = time.monotonic()
    ep, base_pb2, body_req, hdr_req = xds_messages()
    body_bytes, hdr_bytes = body_req.SerializeToString(), hdr_req.SerializeToString()
    xds_resp = build_response(ep, base_pb2, APPEND_ACTION_OVERWRITE)
    sizes = {"body": len(body_bytes), "headers": len(hdr_bytes),
             "response": len(xds_resp.SerializeToString()),
             "json_body": len(body_req.request_body.body)}

    xds_t, xds_check = xds_bench(body_bytes, hdr_bytes)
    versions = {"xds_protos": xds_versions()}
    edp_t = ratio = None
    note = "skipped (--skip-edp)"
    if not args.skip_edp:
        python, note = ensure_edp_venv()
        print(f"envoy-data-plane venv: {note}")
        if python is not None:
            result, err = run_edp(python, body_bytes, hdr_bytes)
            if result is None:
                note = err
            elif normalize(result["check"]) != normalize(xds_check):
                note = "envoy-data-plane decoded different data than xds-protos"
                print(f"{note}:\n  edp {result['check']}\n  xds {xds_check}")
            elif ep.ProcessingResponse.FromString(
                    base64.b64decode(result["response"])) != xds_resp:
                note = "envoy-data-plane encoded a different response than xds-protos"
            else:
                edp_t, versions["envoy_data_plane"] = result["timings"], result["versions"]
                ratio = {op: round(edp_t[op] / xds_t[op], 1) for op in xds_t}
                note = "ok: same decoded data and same response as xds-protos"
        if edp_t is None:
            print(f"envoy-data-plane not measured: {note}; reporting xds-protos only")

    print_table(xds_t, edp_t, ratio, sizes)
    report = {"xds_protos": xds_t, "envoy_data_plane": edp_t, "ratio": ratio,
              "versions": versions, "unit": "us_per_op_median", "message_bytes": sizes,
              "edp_status": note, "repeat": REPEAT}
    REPORT.parent.mkdir(parents=True, exist_ok=True)
    REPORT.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {REPORT.relative_to(ROOT)} in {time.monotonic() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
