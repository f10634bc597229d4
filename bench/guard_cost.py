"""`make bench-guard-cost`: the guard's CPU time per request, and the same measured for another
commit in the same run, alternating, so both share the machine's load.

A request's guard time is the scan (words and personal data, and rewriting the JSON body when
something was masked) plus the injection classifier's scoring of the text and the embedding it
is handed (the embedding itself is the model's, not counted). Each is timed with
time.thread_time(): CPU time of this thread, which other processes' turns on a shared machine
do not inflate as they do wall time (contention for caches and cores still does: hence the
alternating rounds, with the load average of each, and the absolute figures of the quietest).

    python -m bench.guard_cost                      # this tree
    python -m bench.guard_cost --against main       # main and this tree, alternating rounds
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import string
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DETECTORS = ("email", "phone", "card", "iban", "ip", "secret", "private_key")
PROMPT_CHARS = 2048


def workload(root: Path) -> tuple[object, dict[str, list[str]]]:
    """The guard policy (10,000 denied words, masked; every detector, redacting) and the
    prompts of each kind: 200 of 2 KB each, built from ordinary paraphrase prompts."""
    from bench.guard_data import injection_examples
    from sidecar.guard.policy import build_policy
    from sidecar.protos import route_settings_pb2
    lines = (root / "data/guard/denied_words.txt").read_text(encoding="utf-8").splitlines()
    denied = [w.strip() for w in lines if w.strip() and not w.startswith("#")]
    rng = random.Random(7)
    while len(denied) < 10_000:
        denied.append("".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(5, 12))))
    guard = route_settings_pb2.Guard()
    guard.words.add(name="big", words=denied, action="mask")
    for name in DETECTORS:
        guard.personal_data.detectors[name] = "redact"
    policy = build_policy(guard)
    benign = [e.text for e in injection_examples() if e.source == "paraphrase" and e.split == "test"]
    prompts = []
    for i in range(200):
        parts, size = [], 0
        while size < PROMPT_CHARS:
            parts.append(benign[(i * 37 + len(parts)) % len(benign)])
            size += len(parts[-1]) + 1
        prompts.append(" ".join(parts)[:PROMPT_CHARS])
    kinds = {"ascii_clean": prompts,
             "with_email_and_word": [p[:1990] + " a.b@example.com internal only" for p in prompts],
             "non_ascii": ["加微信 " + p[:1000] + " 你好，我想问一下这个问题。" * 20 for p in prompts],
             "log_with_numbers": [p[:1024] + "\n" + _log_lines(rng, PROMPT_CHARS - 1025) for p in prompts]}
    return policy, kinds


def _log_lines(rng: random.Random, size: int) -> str:
    """A pasted log of that many characters: dates, times, order numbers, amounts, versions and
    counts, no personal data (the digits every personal-data pattern must read and reject)."""
    lines, length = [], 0
    while length < size:
        lines.append(f"2024-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d} {rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}:"
                     f"{rng.randint(0, 59):02d} ORD-{rng.randint(2019, 2024)}-{rng.randint(100000, 999999)} qty {rng.randint(1, 40)} "
                     f"total {rng.randint(1, 9999)}.{rng.randint(0, 99):02d} EUR build {rng.randint(1, 12)}.{rng.randint(0, 9)}.{rng.randint(0, 99)}")
        length += len(lines[-1]) + 1
    return "\n".join(lines)[:size]


def measure(root: Path = ROOT, passes: int = 5) -> dict:
    """p50 and p99 CPU milliseconds per request of each prompt kind (scan, injection, total),
    and the p50 over prompts of each prompt's fastest pass (`best_p50_ms`): contention for caches
    and cores only adds time, so that is the nearest this measure comes to an idle machine's."""
    import numpy as np
    from sidecar.guard.check import rewrite_body, scan
    from sidecar.guard.injection import default_head
    policy, kinds = workload(root)
    head = default_head()
    vector = np.random.default_rng(0).standard_normal(head.embedding.shape[0]).astype(np.float32)
    vector /= np.linalg.norm(vector)
    from sidecar.guard import lexical
    out: dict = {"denied_words": policy.words.size, "prompt_chars": PROMPT_CHARS,
                 "compiled_ngrams": getattr(lexical, "COMPILED", False)}
    for name, texts in kinds.items():
        scans, injections, totals = [], [], []
        for _ in range(passes):
            for text in texts:
                messages = [{"role": "user", "content": text}]
                body = json.dumps({"model": "m", "messages": messages}).encode()
                started = time.thread_time()
                result = scan(policy, messages)
                if result.rewrites:
                    rewrite_body(body, result.rewrites)
                scanned = time.thread_time()
                head.score(vector, text)
                ended = time.thread_time()
                scans.append(scanned - started)
                injections.append(ended - scanned)
                totals.append(ended - started)
        out[name] = {part: {"p50_ms": round(statistics.median(values) * 1000, 4),
                            "p99_ms": round(sorted(values)[int(len(values) * 0.99)] * 1000, 4),
                            "best_p50_ms": round(statistics.median(min(values[i::len(texts)]) for i in range(len(texts))) * 1000, 4)}
                     for part, values in (("scan", scans), ("injection", injections), ("total", totals))}
        out[name]["runs"] = len(totals)
    return out


def _tree_of(rev: str) -> Path:
    """`rev`'s files under build/guard-cost/ (git archive), with this tree's generated protos."""
    commit = subprocess.run(["git", "rev-parse", "--short", rev], cwd=ROOT, check=True, capture_output=True, text=True).stdout.strip()
    tree = ROOT / "build" / "guard-cost" / commit
    if not tree.exists():
        tree.mkdir(parents=True)
        archive = subprocess.run(["git", "archive", commit], cwd=ROOT, check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
        shutil.copytree(ROOT / "sidecar" / "gen", tree / "sidecar" / "gen")
        if (tree / "sidecar" / "guard" / "_ngrams.c").exists():
            # Its compiled modules, as `pip install -e .` builds them here (pyproject.toml).
            subprocess.run([sys.executable, "-c", "from setuptools import setup; setup()", "-q", "build_ext", "--inplace"],
                           cwd=tree, check=True, capture_output=True)
    return tree


def _run_in(tree: Path) -> dict:
    """measure() with `tree`'s code, in a fresh interpreter."""
    env = {**os.environ, "PYTHONPATH": str(tree), "SLUICE_SHARED_DATA": str(ROOT.parent / "shared" / "data")}
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "guard_cost.py"), "--tree", str(tree), "--json"],
                          cwd=tree, env=env, check=True, capture_output=True, text=True)
    return json.loads(done.stdout)


def compare(rev: str, rounds: int) -> dict:
    from bench import report
    trees = {rev: _tree_of(rev), "this tree": ROOT}
    runs = []
    for index in range(rounds):
        for label, tree in (trees.items() if index % 2 == 0 else reversed(trees.items())):
            load = os.getloadavg()[0]
            runs.append({"round": index, "code": label, "load_1m": round(load, 2), **_run_in(tree)})
            print(f"round {index} {label}: load {load:.2f}, compiled n-gram scorer: {runs[-1]['compiled_ngrams']}", flush=True)
    kinds = [k for k in runs[0] if isinstance(runs[0][k], dict)]
    rows, summary = [], {}
    for kind in kinds:
        for label in trees:
            mine = [r for r in runs if r["code"] == label]
            quiet = min(mine, key=lambda r: r["load_1m"])
            totals = [r[kind]["total"]["p50_ms"] for r in mine]
            best = min(r[kind]["total"]["best_p50_ms"] for r in mine)
            summary.setdefault(kind, {})[label] = {"total_p50_ms_by_round": totals, "total_best_p50_ms": best, "quietest": {
                "load_1m": quiet["load_1m"], **{part: quiet[kind][part]["p50_ms"] for part in ("scan", "injection", "total")}}}
            # Each round measures both codes back to back: their ratio within a round is what the
            # machine's changing load disturbs least.
            ratios = [r[kind]["total"]["p50_ms"] / o[kind]["total"]["p50_ms"] for r in mine
                      for o in runs if o["round"] == r["round"] and o["code"] == rev]
            summary[kind][label]["total_p50_ratio_to_against_by_round"] = [round(x, 3) for x in ratios]
            rows.append({"prompt": kind, "code": label, "total p50 by round, ms": " ".join(f"{t:.3f}" for t in totals),
                         f"/ {rev}, median of rounds": round(statistics.median(ratios), 3),
                         "quietest load": quiet["load_1m"], "scan": quiet[kind]["scan"]["p50_ms"],
                         "injection": quiet[kind]["injection"]["p50_ms"], "total": quiet[kind]["total"]["p50_ms"],
                         "total, best of passes": best})
    print(report.table(rows, list(rows[0])))
    path = report.write("guard_cost", {"against": rev, "rounds": rounds, "summary": summary, "runs": runs})
    print(f"wrote {path.relative_to(ROOT)}")
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--against", help="a git revision to measure in alternating rounds with this tree")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--tree", help=argparse.SUPPRESS)
    parser.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.against:
        compare(args.against, args.rounds)
        return 0
    result = measure(Path(args.tree) if args.tree else ROOT)
    if args.json:
        print(json.dumps(result))
    else:
        print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    if "--tree" in sys.argv:      # measure another tree's code: its folder first on the path
        sys.path.insert(0, sys.argv[sys.argv.index("--tree") + 1])
    sys.exit(main())
