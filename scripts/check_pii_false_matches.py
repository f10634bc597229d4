"""False matches of the secret and IP detectors on prompts that hold neither.

    nice -n 19 .venv/bin/python scripts/check_pii_false_matches.py

Runs `pii.find(text, ("secret", "ip"))` over the distinct prompts of the paraphrase set
(../shared/data/paraphrase/dev.jsonl, both sides of each pair) and of the injection data
(data/guard/injections.jsonl, data/guard/ordinary.jsonl,
../shared/data/guard/prompt_injections.jsonl), none of which is labelled with a secret or an
address, and prints each file's prompt count, the prompts with a match and the matched text.
Prints only.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.guard_data import SHARED  # noqa: E402
from sidecar.guard import pii  # noqa: E402

FILES = {
    "paraphrase": (SHARED / "paraphrase" / "dev.jsonl", ("a", "b")),
    "injections": (ROOT / "data" / "guard" / "injections.jsonl", ("text",)),
    "ordinary": (ROOT / "data" / "guard" / "ordinary.jsonl", ("text",)),
    "deepset": (SHARED / "guard" / "prompt_injections.jsonl", ("text",)),
}


def texts(path: Path, fields: tuple[str, ...]) -> list[str]:
    seen: dict[str, None] = {}
    with path.open(encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            for field in fields:
                seen.setdefault(row[field], None)
    return list(seen)


def main() -> None:
    for name, (path, fields) in FILES.items():
        prompts = texts(path, fields)
        matched = [(t, spans) for t in prompts if (spans := pii.find(t, ("secret", "ip")))]
        print(f"{name}: {len(prompts)} prompts, {len(matched)} with a secret or IP match")
        for text, spans in matched:
            for span in spans:
                print(f"  {span.detector}: {text[span.start:span.end]!r}")


if __name__ == "__main__":
    main()
