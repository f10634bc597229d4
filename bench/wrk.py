"""Run wrk with a POST body and read its latency percentiles as JSON (via a Lua done())."""
from __future__ import annotations

import json
import pathlib
import subprocess
import tempfile

LUA = """
wrk.method = "POST"
wrk.headers["content-type"] = "application/json"
wrk.headers["authorization"] = "Bearer bench"
local f = io.open("%(body)s", "rb"); wrk.body = f:read("*a"); f:close()
done = function(summary, latency, requests)
  local errors = summary.errors.connect + summary.errors.read + summary.errors.write
               + summary.errors.status + summary.errors.timeout
  io.write(string.format('WRKJSON {"requests": %%d, "seconds": %%f, "errors": %%d, ' ..
    '"p50_ms": %%f, "p90_ms": %%f, "p99_ms": %%f}\\n', summary.requests, summary.duration / 1e6,
    errors, latency:percentile(50) / 1000, latency:percentile(90) / 1000,
    latency:percentile(99) / 1000))
end
"""


def run(url: str, body: bytes, connections: int, seconds: float, threads: int = 1) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        body_path = pathlib.Path(tmp) / "body.json"
        body_path.write_bytes(body)
        script = pathlib.Path(tmp) / "post.lua"
        script.write_text(LUA % {"body": body_path})
        return run_script(url, script, connections, seconds, threads)


def run_script(url: str, script: pathlib.Path, connections: int, seconds: float, threads: int = 1) -> dict:
    """wrk with a Lua script whose done() prints the WRKJSON line (as LUA's does)."""
    out = subprocess.run(["wrk", "-t", str(min(threads, connections)), "-c", str(connections),
                          "-d", f"{max(1, round(seconds))}s", "-s", str(script), url],
                         capture_output=True, text=True, timeout=seconds + 60)
    line = next((l for l in out.stdout.splitlines() if l.startswith("WRKJSON ")), None)
    if line is None:
        raise RuntimeError(f"wrk failed: {out.stdout}\n{out.stderr}")
    result = json.loads(line[len("WRKJSON "):])
    result["rps"] = result["requests"] / result["seconds"]
    return result
