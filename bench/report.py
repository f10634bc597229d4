"""Shared output of the `make bench*` targets: a printed table and reports/<name>.json."""
from __future__ import annotations

import json
import pathlib
import platform
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent


def table(rows: list[dict], columns: list[str]) -> str:
    cells = [[_fmt(row.get(c)) for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    line = lambda values: "  ".join(v.rjust(w) for v, w in zip(values, widths))  # noqa: E731
    return "\n".join([line(columns), line(["-" * w for w in widths]), *map(line, cells)])


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:,.1f}" if abs(value) >= 10 else f"{value:.3f}"
    return "" if value is None else str(value)


def write(name: str, data: dict) -> pathlib.Path:
    path = ROOT / "reports" / f"{name}.json"
    path.parent.mkdir(exist_ok=True)
    data = {"benchmark": name, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "machine": {"cpus": _cpus(), "python": platform.python_version()}, **data}
    path.write_text(json.dumps(data, indent=2))
    return path


def _cpus() -> int:
    import os
    return len(os.sched_getaffinity(0))


def rss_mb(pid: int) -> float:
    """Resident set size of a process, in MiB (Linux)."""
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def cpu_seconds(pid: int, tid: int | None = None) -> float:
    """User + system CPU time of a process (all its threads), or of one of its threads (Linux)."""
    import os
    path = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
    fields = pathlib.Path(path).read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
