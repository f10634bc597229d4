"""Generate labelled chat-prompt pairs for training the semantic verifier.

    .venv/bin/python scripts/gen_semantic_pairs.py --out build/semantic/generated.jsonl

Reads data/semantic/generator/<lang>.json: frames (one question written several ways, with
slots filled from word lists) and per-language synonyms, fillers and long contexts.  Every
pair renders one frame twice:

- label 1 (a rewording): two forms of the frame, or one form perturbed (a synonym swapped,
  a filler added, a typo, all lower case, punctuation dropped, a long shared context), with
  the same slot values;
- label 0 (a hard negative): the same, but with exactly one thing changed: a slot value
  (`entity`, `number`), a varied phrase (`opposite`, `scope`, `audience`, `format`,
  `negation`, `tense`, `quantity`, `code_detail`, `direction`, `attribute`, `exchange`: the
  frame's data names the kind), or two slots exchanged in a frame whose order matters
  (`exchange`).  Swapping the two slots of a frame marked symmetric is a rewording.

Deterministic (seeded); a pair's `frame` id lets training hold whole frames out.  The
hand-written test suites are never produced by these templates.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import random
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GENERATOR_DIR = ROOT / "data" / "semantic" / "generator"
SLOT = re.compile(r"\{([^{}]+)\}")


def frame_half(frame_id: str) -> str:
    """Frames, not pairs, are split: a held-out frame's wording was never trained on."""
    return "valid" if hashlib.sha256(frame_id.encode()).digest()[0] % 5 == 0 else "train"


class Frame:
    def __init__(self, lang: str, index: int, spec: dict, data: dict):
        self.id = f"{lang}-{index:03d}"
        self.lang, self.domain = lang, spec["domain"]
        self.forms: list[str] = spec["forms"]
        self.vary: dict = spec.get("vary", {})
        self.order = spec.get("pair_order")          # "ordered" | "symmetric" | None
        self.exchange = spec.get("exchange")          # a slot whose value is "x|y": swapping is a negative
        self.slots, self.numbers = data["slots"], data["numbers"]
        names = {m.group(1) for f in self.forms for m in SLOT.finditer(f)}
        self.slot_names = sorted({n.split("#")[0].split(".")[0] for n in names
                                  if not n.startswith(("=", "n:"))})
        self.number_names = sorted({n for n in names if n.startswith("n:")})
        self.two = sorted({n.split("#")[0] for n in names if "#" in n})

    def fill(self, rng: random.Random) -> dict:
        values = {}
        for name in self.slot_names:
            pool = self.slots[name]
            picked = rng.sample(pool, 2) if name in self.two else [rng.choice(pool)]
            values[name] = picked[0]
            if name in self.two:
                values[name + "#2"] = picked[1]
        for name in self.number_names:
            lo, hi = self.numbers[name[2:]]
            values[name] = str(rng.randint(lo, hi))
        for key, spec in self.vary.items():
            values["=" + key] = rng.choice(spec["values"])
        return values

    def render(self, form: str, values: dict) -> str:
        def sub(match):
            name = match.group(1)
            if "." in name:
                slot, part = name.split(".")
                return values[slot].split("|")[int(part)]
            return values[name]
        text = SLOT.sub(sub, form)
        return text[0].upper() + text[1:] if form[0] == "{" and text[0].islower() and form != form.lower() else text

    def changes(self, values: dict, rng: random.Random) -> list[tuple[str, dict]]:
        """(kind, values) for every one-thing change of `values` that asks something else."""
        out = []
        for name in self.slot_names:
            others = [v for v in self.slots[name] if v not in (values[name], values.get(name + "#2"))]
            if others:
                out.append(("entity", {**values, name: rng.choice(others)}))
        for name in self.number_names:
            lo, hi = self.numbers[name[2:]]
            new = values[name]
            while new == values[name]:
                new = str(rng.randint(lo, hi))
            out.append(("number", {**values, name: new}))
        for key, spec in self.vary.items():
            others = [v for v in spec["values"] if v != values["=" + key]]
            out.append((spec["kind"], {**values, "=" + key: rng.choice(others)}))
        if self.order == "ordered":
            for name in self.two:
                out.append(("exchange", {**values, name: values[name + "#2"], name + "#2": values[name]}))
        if self.exchange:
            x, y = values[self.exchange].split("|")
            out.append(("direction", {**values, self.exchange: f"{y}|{x}"}))
        return out


class Perturb:
    """Rewordings that keep the question: one language's synonyms, fillers, contexts."""

    def __init__(self, data: dict):
        self.synonyms = [group for group in data.get("synonyms", [])]
        self.prefix = data["fillers"]["prefix"]
        self.suffix = data["fillers"]["suffix"]
        self.contexts = data.get("contexts", [])

    def synonym(self, text: str, rng: random.Random) -> str | None:
        groups = [g for g in self.synonyms if any(re.search(rf"(?i)\b{re.escape(w)}\b", text) for w in g)]
        if not groups:
            return None
        group = rng.choice(groups)
        present = next(w for w in group if re.search(rf"(?i)\b{re.escape(w)}\b", text))
        other = rng.choice([w for w in group if w != present])
        return re.sub(rf"(?i)\b{re.escape(present)}\b", other, text, count=1)

    def filler(self, text: str, rng: random.Random) -> str:
        if rng.random() < 0.5:
            prefix = rng.choice(self.prefix)
            return prefix + (text[0].lower() + text[1:] if text[:1].isupper() and text[1:2].islower() else text)
        return text + rng.choice(self.suffix)

    @staticmethod
    def typo(text: str, rng: random.Random) -> str | None:
        words = [m for m in re.finditer(r"[a-záéíóúüöäñç]{6,}", text)]
        if not words:
            return None
        m = rng.choice(words)
        i = m.start() + rng.randint(1, len(m.group()) - 3)
        return text[:i] + text[i + 1] + text[i] + text[i + 2:]

    @staticmethod
    def lower(text: str, rng: random.Random) -> str:
        return text.lower().rstrip("?.!")

    def apply(self, text: str, rng: random.Random) -> tuple[str, str]:
        kind = rng.choice(("synonym", "filler", "typo", "lower", "none", "none"))
        changed = {"synonym": self.synonym, "filler": self.filler, "typo": self.typo,
                   "lower": self.lower}.get(kind, lambda t, r: None)(text, rng)
        return (changed, kind) if changed else (text, "none")


def pairs_of(frame: Frame, perturb: Perturb, rng: random.Random, per_frame: int) -> list[dict]:
    out = []

    def emit(a, b, label, kind):
        if a != b:
            out.append({"a": a, "b": b, "label": label, "kind": kind, "lang": frame.lang,
                        "domain": frame.domain, "frame": frame.id})

    for _ in range(per_frame):
        values = frame.fill(rng)
        form_a, form_b = rng.choice(frame.forms), rng.choice(frame.forms)
        # Half the rewordings keep the form and change a detail of wording, as half the hard
        # negatives keep it and change one thing: lexical distance alone must not tell them apart.
        same_form = rng.random() < 0.5
        if same_form:
            form_b = form_a
        a = frame.render(form_a, values)
        # A rewording: another form, and now and then a perturbation of either side.
        b, how = perturb.apply(frame.render(form_b, values), rng)
        if form_a == form_b and how == "none":
            b, how = perturb.filler(b, rng), "filler"
        kind = "form" if how == "none" else how
        if rng.random() < 0.3:
            a, _ = perturb.apply(a, rng)
        if frame.order == "symmetric" and frame.two and rng.random() < 0.3:
            name = frame.two[0]
            b = frame.render(form_b, {**values, name: values[name + "#2"], name + "#2": values[name]})
            kind = "reorder"
        if perturb.contexts and rng.random() < 0.1:
            context = rng.choice(perturb.contexts)
            a, b, kind = f"{context} {a}", f"{context} {b}", "long"
        emit(a, b, 1, kind)
        # A hard negative: one thing changed, rendered in the same or another form.
        changes = frame.changes(values, rng)
        if not changes:
            continue
        # A kind first, then a change of that kind: slots outnumber the rest and are the easy ones.
        change_kind = rng.choice(sorted({k for k, _ in changes}))
        other = rng.choice([v for k, v in changes if k == change_kind])
        same_form = rng.random() < 0.5
        a = frame.render(form_a, values)
        b = frame.render(form_a if same_form else form_b, other)
        if rng.random() < 0.3:
            b, _ = perturb.apply(b, rng)
        if perturb.contexts and rng.random() < 0.1:
            context = rng.choice(perturb.contexts)
            a, b = f"{context} {a}", f"{context} {b}"
        emit(a, b, 0, change_kind)
    return out


def generate(per_frame: int = 40, seed: int = 17, directory: Path = GENERATOR_DIR) -> list[dict]:
    rng = random.Random(seed)
    pairs = []
    for path in sorted(directory.glob("*.json")):
        data = json.loads(path.read_text(encoding="utf-8"))
        perturb = Perturb(data)
        for index, spec in enumerate(data["frames"]):
            frame = Frame(data["lang"], index, spec, data)
            pairs.extend(pairs_of(frame, perturb, rng, per_frame))
    # One copy of each (a, b) pair, first label wins (a repeat is the same draw).
    seen, unique = set(), []
    for pair in pairs:
        key = (pair["a"], pair["b"])
        if key not in seen:
            seen.add(key)
            unique.append({**pair, "half": frame_half(pair["frame"])})
    return unique


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "build" / "semantic" / "generated.jsonl")
    parser.add_argument("--per-frame", type=int, default=40)
    parser.add_argument("--seed", type=int, default=17)
    args = parser.parse_args(argv)
    pairs = generate(args.per_frame, args.seed)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as handle:
        for pair in pairs:
            handle.write(json.dumps(pair, ensure_ascii=False) + "\n")
    by = {}
    for p in pairs:
        by[(p["label"], p["kind"])] = by.get((p["label"], p["kind"]), 0) + 1
    print(f"{len(pairs)} pairs -> {args.out}: " + ", ".join(f"{k[1]}={v}" for k, v in sorted(by.items())),
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
