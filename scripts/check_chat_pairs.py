"""Check a suite of chat-prompt pairs, and drop pairs that come too close to other suites.

    python3 scripts/check_chat_pairs.py data/semantic/chat-holdout
    python3 scripts/check_chat_pairs.py data/semantic/chat-holdout \\
        --drop-near data/semantic/chat-test data/semantic/handwritten.jsonl

The check: every line parses to an object with exactly the seven keys (id, a, b, label, kind,
lang, domain), ids are unique across files, a != b, label is 0 or 1 with a kind allowed for that
label, and no pair repeats (in either order).  Exits 1 on any problem.

--drop-near rewrites the suite without any pair whose a or b has a character 5-gram Jaccard
above --max-jaccard with any text in the given files or folders of *.jsonl.  A held-out suite
must be independent of the suites it is compared with, so a near copy is removed, not kept.
Only counts and the suite's own ids are printed: the other suites' text is never shown.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

from drop_chat_overlap import Index  # the same near-copy measure as the training side

KEYS = {"id", "a", "b", "label", "kind", "lang", "domain"}
KINDS = {
    1: {"synonym", "register", "question-instruction", "filler", "typo", "long-context", "polite",
        "reorder", "case", "length", "spelling", "code-reword"},
    0: {"entity", "opposite", "number", "attribute", "swap", "scope", "direction", "tense",
        "code-detail", "audience", "format", "negation", "quantity", "language", "condition",
        "unit"},
}
LANGS = {"en", "es", "fr", "de", "pt", "it", "zh", "ja", "ru", "ko"}


def jsonl_files(path: Path) -> list[Path]:
    return sorted(path.glob("*.jsonl")) if path.is_dir() else [path]


def check(files: list[Path]) -> list[str]:
    problems: list[str] = []
    ids: set[str] = set()
    pairs: set[tuple[str, str]] = set()
    for f in files:
        for n, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1):
            where = f"{f.name}:{n}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                problems.append(f"{where}: not JSON ({e.msg})")
                continue
            if not isinstance(row, dict) or set(row) != KEYS:
                problems.append(f"{where}: keys must be exactly {sorted(KEYS)}")
                continue
            if row["id"] in ids:
                problems.append(f"{where}: duplicate id {row['id']}")
            ids.add(row["id"])
            a, b = row["a"], row["b"]
            if not (isinstance(a, str) and isinstance(b, str) and a.strip() and b.strip()):
                problems.append(f"{where}: a and b must be non-empty strings")
                continue
            if a == b:
                problems.append(f"{where}: a == b")
            key = (a, b) if a <= b else (b, a)
            if key in pairs:
                problems.append(f"{where}: duplicate pair")
            pairs.add(key)
            if row["label"] not in KINDS or isinstance(row["label"], bool):
                problems.append(f"{where}: label must be 0 or 1")
            elif row["kind"] not in KINDS[row["label"]]:
                problems.append(f"{where}: kind {row['kind']!r} is not a label-{row['label']} kind")
            if row["lang"] not in LANGS:
                problems.append(f"{where}: unknown lang {row['lang']!r}")
    return problems


def strings(value: object) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for v in value.values() for s in strings(v)]
    if isinstance(value, list):
        return [s for v in value for s in strings(v)]
    return []


def drop_near(files: list[Path], others: list[Path], limit: float) -> int:
    texts = [s for f in others for line in f.read_text(encoding="utf-8").splitlines() if line.strip()
             for s in strings(json.loads(line))]
    index = Index(texts)
    print(f"compared with {len(texts)} texts in {len(others)} files; limit Jaccard > {limit}")
    dropped = 0
    for f in files:
        kept = []
        for line in f.read_text(encoding="utf-8").splitlines():
            row = json.loads(line)
            score = max(index.highest(row["a"]), index.highest(row["b"]))
            if score > limit:
                dropped += 1
                print(f"  drop {row['id']} (Jaccard {score:.2f})")
            else:
                kept.append(line)
        f.write_text("".join(k + "\n" for k in kept), encoding="utf-8")
    return dropped


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("suite", type=Path, help="a folder of *.jsonl or one .jsonl file")
    ap.add_argument("--drop-near", nargs="+", type=Path, default=[], metavar="PATH")
    ap.add_argument("--max-jaccard", type=float, default=0.5)
    args = ap.parse_args()
    files = jsonl_files(args.suite)
    problems = check(files)
    for p in problems:
        print(p)
    if problems:
        return 1
    if args.drop_near:
        others = [f for p in args.drop_near for f in jsonl_files(p)]
        print(f"dropped {drop_near(files, others, args.max_jaccard)} pairs")
    rows = [json.loads(line) for f in files for line in f.read_text(encoding="utf-8").splitlines()]
    print(f"{len(rows)} pairs in {len(files)} files: "
          + ", ".join(f"label {k}: {v}" for k, v in sorted(Counter(r["label"] for r in rows).items())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
