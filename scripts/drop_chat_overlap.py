"""Keep training pairs apart from the chat test suites: drop any pair with a text too like a test text.

    .venv/bin/python scripts/drop_chat_overlap.py NEW.jsonl [--into data/semantic/handwritten.jsonl]
    .venv/bin/python scripts/drop_chat_overlap.py data/semantic/handwritten.jsonl --rewrite

A pair is dropped when either of its texts has a character 5-gram Jaccard similarity above 0.5
with any text of the held-out chat suites, data/semantic/chat-test/, chat-holdout/ and chat-holdout2/
(lower case, runs of white space as one). Only counts are printed, never a test text: the suites
stay unseen by whoever writes training pairs. With
--into, the kept pairs not already there (same a and b) are appended to that file; with
--rewrite, the input file keeps only its kept pairs.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEST_DIRS = tuple(ROOT / "data" / "semantic" / name for name in ("chat-test", "chat-holdout", "chat-holdout2"))
N = 5
LIMIT = 0.5


def grams(text: str) -> set[str]:
    text = re.sub(r"\s+", " ", text.lower()).strip()
    return {text[i:i + N] for i in range(max(1, len(text) - N + 1))}


class Index:
    """Inverted index of the test texts' n-grams: the highest Jaccard of a text against them."""

    def __init__(self, texts: list[str]):
        self.sizes = []
        self.posting: dict[str, list[int]] = defaultdict(list)
        for i, text in enumerate(texts):
            g = grams(text)
            self.sizes.append(len(g))
            for gram in g:
                self.posting[gram].append(i)

    def highest(self, text: str) -> float:
        g = grams(text)
        shared: dict[int, int] = defaultdict(int)
        for gram in g:
            for i in self.posting.get(gram, ()):
                shared[i] += 1
        return max((k / (len(g) + self.sizes[i] - k) for i, k in shared.items()), default=0.0)


def test_texts() -> list[str]:
    return sorted({t for folder in TEST_DIRS for path in sorted(folder.glob("*.jsonl"))
                   for p in load_jsonl(path) for t in (p["a"], p["b"])})


def load_jsonl(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("pairs", type=Path)
    parser.add_argument("--into", type=Path)
    parser.add_argument("--rewrite", action="store_true")
    args = parser.parse_args(argv)
    test = test_texts()
    index = Index(test)
    pairs = load_jsonl(args.pairs)
    kept = [p for p in pairs if max(index.highest(p["a"]), index.highest(p["b"])) <= LIMIT]
    dropped = len(pairs) - len(kept)
    print(f"{len(pairs)} pairs, {dropped} dropped (a text's char {N}-gram Jaccard > {LIMIT} with one of "
          f"{len(test)} held-out chat texts), {len(kept)} kept")
    if args.rewrite:
        with open(args.pairs, "w", encoding="utf-8") as handle:
            for p in kept:
                handle.write(json.dumps(p, ensure_ascii=False) + "\n")
    if args.into:
        have = {(p["a"], p["b"]) for p in load_jsonl(args.into)} if args.into.exists() else set()
        new = [p for p in kept if (p["a"], p["b"]) not in have and (p["b"], p["a"]) not in have]
        with open(args.into, "a", encoding="utf-8") as handle:
            for p in new:
                handle.write(json.dumps(p, ensure_ascii=False) + "\n")
        print(f"appended {len(new)} to {args.into}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
