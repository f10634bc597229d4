"""Set-ups compared side by side, taking turns: on a shared 2-core machine a minute's drift moves
req/s by 20-30%, which measuring one set-up after the other would put into their ratio."""
from __future__ import annotations

import statistics
from typing import Callable, Iterable


def in_turns(runs: dict[str, Callable[[int], dict]], concurrencies: Iterable[int],
             turns: int) -> dict[str, list[dict]]:
    """Per concurrency, each set-up's run (a wrk point) `turns` times, which set-up goes first
    alternating; per point the run of median req/s, with every turn's req/s in `rps_turns`."""
    results: dict[str, list[dict]] = {name: [] for name in runs}
    for c in concurrencies:
        points: dict[str, list[dict]] = {name: [] for name in runs}
        for turn in range(turns):
            order = list(runs.items())
            for name, run in (order if turn % 2 == 0 else reversed(order)):   # neither always first
                points[name].append({"concurrency": c, **run(c)})
        for name, taken in points.items():
            median = sorted(taken, key=lambda p: p["rps"])[len(taken) // 2]
            results[name].append({**median, "rps_turns": [p["rps"] for p in taken]})   # in turn order
    return results


def ratio(point: dict, baseline: dict) -> float:
    """req/s over the baseline's, per turn (the two measured back to back), the median turn."""
    return statistics.median(a / b for a, b in zip(point["rps_turns"], baseline["rps_turns"]))
