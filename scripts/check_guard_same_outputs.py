"""The guard's outputs on every data prompt, against another commit's: a change made for speed
must leave them as they were.

    nice -n 19 .venv/bin/python scripts/check_guard_same_outputs.py --against main

Reads every prompt of data/guard/ (the jsonl files and the hand-written .txt files),
../shared/data/guard/prompt_injections.jsonl and ../shared/data/paraphrase/dev.jsonl (both
sides), each also with a pasted log of numbers appended (bench.guard_cost's), and for each
writes, in this tree and in the other commit's (a fresh interpreter each, as bench.guard_cost
runs them): the scan's findings and rewritten texts under the cost bench's policy (10,000
masked words, every personal-data detector redacting), every detector's spans with their
scores, and the injection classifier's scores (n-grams alone, and with a fixed embedding).
Prints the number of prompts and of those whose outputs differ (the first few, in full), and
exits 1 when any differs. tests/unit/guard/test_guard.py checks a sample of the same prompts
in one tree (ranges against the whole text).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def prompts(root: Path = ROOT) -> list[str]:
    from bench.guard_cost import _log_lines
    from bench.guard_data import SHARED, pii_handwritten
    seen: dict[str, None] = {}
    for path in sorted((root / "data" / "guard").glob("*.jsonl")) + [SHARED / "guard" / "prompt_injections.jsonl"]:
        for line in path.read_text(encoding="utf-8").split("\n"):
            if line.strip() and isinstance(text := json.loads(line).get("text"), str):
                seen.setdefault(text, None)
    for path in sorted((root / "data" / "guard").glob("pii_*.txt")):
        for row in pii_handwritten(path):
            seen.setdefault(row["text"], None)
    for line in (SHARED / "paraphrase" / "dev.jsonl").read_text(encoding="utf-8").split("\n"):
        if line.strip():
            row = json.loads(line)
            seen.setdefault(row["a"], None)
            seen.setdefault(row["b"], None)
    texts = list(seen)
    rng = random.Random(22)
    logged = [t + "\n" + _log_lines(rng, 600) for t in rng.sample(texts, 2000)]
    return texts + logged


def outputs(texts: list[str]) -> list[str]:
    """One JSON line per text, in this interpreter's code."""
    import numpy as np
    from bench.guard_cost import DETECTORS, workload
    from sidecar.guard import pii
    from sidecar.guard.check import scan
    from sidecar.guard.injection import default_head
    policy, _ = workload(ROOT)
    head = default_head()
    vector = np.random.default_rng(0).standard_normal(head.embedding.shape[0]).astype(np.float32)
    vector /= np.linalg.norm(vector)
    out = []
    for text in texts:
        result = scan(policy, [{"role": "user", "content": text}])
        spans = pii.find(text, DETECTORS)
        out.append(json.dumps({
            "findings": [[f.detector, f.action, f.rule, f.score, f.count] for f in result.findings],
            "rewrites": [[list(k), v] for k, v in sorted(result.rewrites.items())],
            "spans": [[s.detector, s.start, s.end, s.score] for s in spans],
            "scores": [repr(head.score(None, text)), repr(head.score(vector, text))]}))
    return out


def _in(tree: Path, texts_path: Path) -> list[str]:
    env = {**os.environ, "PYTHONPATH": str(tree), "SLUICE_SHARED_DATA": str(ROOT.parent / "shared" / "data")}
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "check_guard_same_outputs.py"), "--tree", str(tree),
                           "--texts", str(texts_path)], cwd=tree, env=env, check=True, capture_output=True, text=True)
    return done.stdout.split("\n")[:-1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--against", default="main")
    parser.add_argument("--tree", help=argparse.SUPPRESS)
    parser.add_argument("--texts", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.texts:
        texts = json.loads(Path(args.texts).read_text(encoding="utf-8"))
        print("\n".join(outputs(texts)))
        return 0
    from bench.guard_cost import _tree_of
    texts = prompts()
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "texts.json"
        path.write_text(json.dumps(texts, ensure_ascii=False), encoding="utf-8")
        theirs, mine = _in(_tree_of(args.against), path), _in(ROOT, path)
    differ = [i for i, (a, b) in enumerate(zip(theirs, mine)) if a != b]
    print(f"{len(texts)} prompts, {len(theirs)} and {len(mine)} outputs, {len(differ)} differ from {args.against}'s")
    for i in differ[:5]:
        print(json.dumps(texts[i], ensure_ascii=False)[:400], "\n  theirs:", theirs[i][:600], "\n  mine:  ", mine[i][:600])
    return 1 if differ or not len(theirs) == len(mine) == len(texts) else 0


if __name__ == "__main__":
    if "--tree" in sys.argv:      # another tree's code: its folder first on the path
        sys.path.insert(0, sys.argv[sys.argv.index("--tree") + 1])
    else:
        sys.path.insert(0, str(ROOT))
    sys.exit(main())
