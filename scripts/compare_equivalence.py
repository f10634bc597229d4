"""Does sidecar/cache/equivalence.py decide every labelled pair as another revision of it did?

    .venv/bin/python scripts/compare_equivalence.py --against main

Loads the other revision's equivalence.py (and the stopwords it read) from git next to the
working tree's, and for every pair of ../shared/data/paraphrase/dev.jsonl, data/semantic/
(chat-test, handwritten) and the generator's pairs compares the two: each prompt's profile,
every check's finding (`disagreements`), the least cosine needed (`requirement`) and
`same_question` over a grid of cosines with the default settings and with each check
switched off.  The checks read the embedding only through the cosine, so the grid covers
every cosine the server could see.  Exit status 1 and the first differences when any differ.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from sidecar.cache import equivalence as new  # noqa: E402
from sidecar.cache.same_question import same_question as new_same_question  # noqa: E402

COSINES = (0.0, 0.5, 0.9, 0.92, 0.93, 0.94, 0.95, 0.96, 0.97, 0.98, 0.99, 1.0)
SWITCHED_COSINES = (0.93, 0.96, 1.0)     # with a check switched off (the default has them all)
# The tables, old name -> how the new module holds them.
TABLES = ("_UNITS", "_TENS", "_SCALES", "_ORDINALS", "_NUMBER_WORDS", "_NEGATIONS", "_INTERROGATIVES",
          "_RELATIVES", "_COMPARISONS", "_PARTICLES", "_TENSES", "_QUANTIFIERS", "_PERSONS", "_NOT_LABELS",
          "_GRADABLE", "_STOPWORDS", "_DIRECTIONS", "_INFINITIVE_AFTER", "_SYMMETRIC", "_UNITS_OF",
          "_NOT_ENTITIES", "_NEGATING_PREFIXES")
SWITCHES = ("check_numbers", "check_negation", "check_question_words", "check_comparisons",
            "check_entities", "check_word_order", "check_symbols", "check_tense", "check_quantifiers",
            "check_content_words", "check_case")


def _git_show(rev: str, path: str) -> str:
    return subprocess.run(["git", "show", f"{rev}:{path}"], cwd=ROOT, check=True,
                          capture_output=True, text=True).stdout


def load_old(rev: str) -> types.ModuleType:
    """The revision's equivalence module, with the stopwords of that revision."""
    stop = types.ModuleType("_old_stopwords")
    exec(compile(_git_show(rev, "sidecar/cache/stopwords.py"), "old stopwords.py", "exec"), stop.__dict__)
    sys.modules["_old_stopwords"] = stop
    source = _git_show(rev, "sidecar/cache/equivalence.py").replace(
        "from sidecar.cache.stopwords import STOPWORDS", "from _old_stopwords import STOPWORDS")
    old = types.ModuleType("_old_equivalence")
    sys.modules["_old_equivalence"] = old          # dataclasses look their module up
    exec(compile(source, "old equivalence.py", "exec"), old.__dict__)
    return old


def load_pairs(paraphrase: Path) -> list[tuple[str, str]]:
    from gen_semantic_pairs import generate
    files = [paraphrase, ROOT / "data" / "semantic" / "handwritten.jsonl",
             *sorted((ROOT / "data" / "semantic" / "chat-test").glob("*.jsonl"))]
    pairs = []
    for path in files:
        with open(path, encoding="utf-8") as handle:
            pairs += [(row["a"], row["b"]) for row in map(json.loads, handle) if row]
    pairs += [(p["a"], p["b"]) for p in generate()]
    return pairs


def _settings(module, **changes):
    # The checks are compared: the verifier (on by default) would decide instead of them.
    if "max_false_hit_rate" in {f.name for f in dataclasses.fields(module.EquivalenceSettings)}:
        changes.setdefault("max_false_hit_rate", 0.0)
    return module.EquivalenceSettings(**changes)


def compare(old, pairs: list[tuple[str, str]], limit: int = 10) -> tuple[int, list[str]]:
    """(comparisons made, the first `limit` differences)."""
    diffs: list[str] = []
    made = 0
    variants = [{}] + [{name: not getattr(new.EquivalenceSettings(), name)} for name in SWITCHES]
    settings = [(_settings(old, **v), _settings(new, **v), v) for v in variants]
    for name in TABLES:
        made += 1
        if getattr(old, name) != getattr(new, name):
            diffs.append(f"table {name}")
    if set(map(frozenset, old._SWAPPED_PREFIXES)) != set(map(frozenset, new._SWAPPED_PREFIXES)):
        diffs.append("table _SWAPPED_PREFIXES")
    opposed = getattr(old, "_OPPOSED_CLASSES", None) or {frozenset(old._KEEP_LOSE)}
    if opposed != new._OPPOSED_CLASSES:
        diffs.append("table _OPPOSED_CLASSES")
    for text in sorted({t for pair in pairs for t in pair}):
        made += 1
        if dataclasses.astuple(old.profile(text)) != dataclasses.astuple(new.profile(text)):
            diffs.append(f"profile of {text!r}")
    for a, b in pairs:
        made += 1
        if dataclasses.astuple(old.disagreements(a, b)) != dataclasses.astuple(new.disagreements(a, b)):
            diffs.append(f"disagreements of {(a, b)!r}")
        for old_s, new_s, variant in settings:
            r_old, r_new = old.requirement(a, b, old_s), new.requirement(a, b, new_s)
            made += 1
            if (r_old.min_cosine, r_old.reason) != (r_new.min_cosine, r_new.reason):
                diffs.append(f"requirement {variant} of {(a, b)!r}: {r_old} / {r_new}")
            for cosine in COSINES if not variant else SWITCHED_COSINES:
                v_old, v_new = old.same_question(a, b, cosine, old_s), new_same_question(a, b, cosine, new_s)
                made += 1
                if (v_old.hit, v_old.reason) != (v_new.hit, v_new.reason):
                    diffs.append(f"same_question {variant} at {cosine} of {(a, b)!r}: {v_old} / {v_new}")
        if len(diffs) >= limit:
            break
    return made, diffs[:limit]


def main(argv=None) -> int:
    from tune_semantic import DEFAULT_PAIRS
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--against", default="main", help="git revision to compare with (default main)")
    parser.add_argument("--pairs", type=Path, default=Path(os.environ.get("SLUICE_PARAPHRASE", DEFAULT_PAIRS)))
    args = parser.parse_args(argv)
    old = load_old(args.against)
    old.forget_profiles(max_bytes=None)
    new.forget_profiles(max_bytes=None)
    pairs = load_pairs(args.pairs)
    made, diffs = compare(old, pairs)
    verdicts = len(pairs) * (len(COSINES) + len(SWITCHES) * len(SWITCHED_COSINES))
    print(f"{len(pairs)} pairs, {len({t for p in pairs for t in p})} prompts; {made} comparisons, "
          f"{verdicts} same_question verdicts (default settings at {len(COSINES)} cosines, each of "
          f"{len(SWITCHES)} checks switched over at {len(SWITCHED_COSINES)})")
    if diffs:
        print("DIFFERENT:", *diffs, sep="\n  ")
        return 1
    print(f"identical to {args.against}: profiles, disagreements, requirements and verdicts")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
