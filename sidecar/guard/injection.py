"""Prompt-injection classifier: one logistic model over the prompt's MiniLM embedding and its
hashed character n-grams, and a second one over the n-grams alone for prompts without an
embedding.

The sidecar already embeds the last user turn for the semantic cache; the classifier reads that
vector (no second model run) and the text itself (sidecar/guard/lexical.py: the words that make
an order out of a question, which the embedding blurs). Trained by scripts/train_guard.py on
data/guard/ and ../shared/data (its README). The weights file also holds the scores the
classifier gave ordinary validation prompts, so a route's threshold is set as the share of
ordinary prompts it may flag (`false_alarm_rate`), the unit an operator reasons in. Those
prompts come in groups (English paraphrase prompts; ordinary prompts in other languages) and
the rate must hold in each: the threshold is the highest of the groups' own, so prompts in a
language the models read poorly are not flagged more often because English ones are many.

The embedding of a pasted document with an order appended reads mostly the document: a prompt of
several paragraphs scores the higher of the full model's score and the n-gram model's score of
its last paragraph (the head file says so, as its calibration was scored that way).

The model refuses text whose tokens its English vocabulary mostly lacks (much Chinese, Japanese,
Korean, Arabic) and gives no vector when the embedding queue is full or no model is loaded; such
a prompt is still judged, by the n-gram model (`TextHead`), at its own threshold for the same
false-alarm rate.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from sidecar.guard import lexical

WEIGHTS = Path(__file__).with_name("injection_head.npz")
DEFAULT_FALSE_ALARM_RATE = 0.001


def threshold_for(benign_scores: np.ndarray, false_alarm_rate: float, groups: np.ndarray | None = None) -> float:
    """The lowest threshold that flags (score >= it) at most floor(false_alarm_rate * n) of the
    n benign prompts of each of their `groups` (one label per score; None: one group): the rate
    is a ceiling, so a group too small to spare one prompt at that rate (n below
    1 / false_alarm_rate) gets a threshold above its highest score. The scores may be in any
    order."""
    if not 0.0 < false_alarm_rate < 1.0:
        raise ValueError(f"false_alarm_rate must be in (0, 1), got {false_alarm_rate}")
    if not len(benign_scores):
        raise ValueError("the head file holds no calibration scores: no threshold for any false_alarm_rate")
    parts = [benign_scores] if groups is None else [benign_scores[groups == g] for g in np.unique(groups)]
    return max(_above(part.astype(np.float32), false_alarm_rate) for part in parts if len(part))


def _above(scores: np.ndarray, rate: float) -> float:
    # 1e-9: a product such as 0.29 * 100 lands just below the whole number it stands for.
    allowed = math.floor(rate * len(scores) + 1e-9)
    if allowed >= len(scores):
        return 0.0
    # The (allowed + 1)-th highest score and those below it stay unflagged: the next float32
    # above it (a live float64 score of that prompt rounds to it, so stays below).
    kept = np.partition(scores, len(scores) - 1 - allowed)[len(scores) - 1 - allowed]
    return float(np.nextafter(kept, np.float32(np.inf)))


def _calibration(data, prefix: str) -> tuple[np.ndarray, np.ndarray | None]:
    """Stored scores (ascending: `_stored` writes them so), with their groups (None for a file
    without them)."""
    scores = data[f"{prefix}benign_scores"].astype(np.float32)
    groups = data[f"{prefix}benign_groups"].astype(np.int8) if f"{prefix}benign_groups" in data else None
    return scores, groups


def _stored(prefix: str, scores: np.ndarray, groups: np.ndarray | None) -> dict:
    order = np.argsort(scores, kind="stable")
    out = {f"{prefix}benign_scores": scores[order].astype(np.float32)}
    if groups is not None:
        out[f"{prefix}benign_groups"] = groups[order].astype(np.int8)
    return out


_BLANK_LINE = re.compile(r"\n\s*\n")


def last_paragraph(text: str) -> str | None:
    """The last paragraph (parts split by a blank line) of a text of more than one, else None.
    Read in the text's last lexical.MAX_CHARS characters, as much as the n-gram model reads."""
    parts = [p for p in _BLANK_LINE.split(text[-lexical.MAX_CHARS:].strip()) if p.strip()]
    return parts[-1] if len(parts) > 1 else None


def _logistic(logit: float) -> float:
    return 0.5 * (1.0 + math.tanh(logit / 2))     # without overflow


@dataclass(frozen=True)
class TextHead:
    """The n-gram part alone: the judge of a prompt that has no embedding."""
    lexical: np.ndarray         # [lexical.DIM] weights of the n-gram buckets
    bias: float
    benign_scores: np.ndarray   # scores of ordinary validation prompts (calibration)
    benign_groups: np.ndarray | None = None     # each score's group (None: one group)

    def score(self, text: str) -> float:
        return _logistic(lexical.score(self.lexical, text) + self.bias)

    def threshold(self, false_alarm_rate: float) -> float:
        return threshold_for(self.benign_scores, false_alarm_rate, self.benign_groups)


def _sparse(prefix: str, weights: np.ndarray) -> dict:
    used = np.flatnonzero(weights)     # most buckets never occur in training: stored sparse
    return {f"{prefix}lexical_index": used.astype(np.int32), f"{prefix}lexical_weight": weights[used].astype(np.float16)}


def _dense(data, prefix: str) -> np.ndarray:
    weights = np.zeros(lexical.DIM, np.float32)
    weights[data[f"{prefix}lexical_index"]] = data[f"{prefix}lexical_weight"].astype(np.float32)
    return weights


@dataclass(frozen=True)
class InjectionHead:
    embedding: np.ndarray       # [dim] weights of the unit embedding
    lexical: np.ndarray         # [lexical.DIM] weights of the n-gram buckets
    bias: float
    benign_scores: np.ndarray   # scores of ordinary validation prompts (calibration)
    text: TextHead | None = None
    benign_groups: np.ndarray | None = None     # each score's group (None: one group)
    # A prompt of several paragraphs also scores as its last paragraph read by the n-gram
    # model: the file says so, as its calibration was scored that way.
    last_paragraph: bool = False

    def __post_init__(self) -> None:
        # Its calibration was scored with the n-gram model's reading of last paragraphs: without
        # that model the thresholds would not mean the rate.
        if self.last_paragraph and self.text is None:
            raise ValueError("an injection head that scores last paragraphs needs its n-gram model")

    @classmethod
    def load(cls, path: Path = WEIGHTS) -> "InjectionHead":
        with np.load(path) as data:
            if int(data["lexical_dim_bits"]) != lexical.DIM_BITS or tuple(data["lexical_orders"]) != lexical.ORDERS:
                raise ValueError(f"{path} was trained with other lexical features: run `make guard-model`")
            text = None
            if "text_bias" in data:
                text = TextHead(_dense(data, "text_"), float(data["text_bias"]), *_calibration(data, "text_"))
            scores, groups = _calibration(data, "")
            tail = bool(data["last_paragraph"]) if "last_paragraph" in data else False
            return cls(data["embedding"].astype(np.float32), _dense(data, ""), float(data["bias"]), scores, text, groups,
                       tail)

    def save(self, path: Path) -> None:
        text = {}
        if self.text is not None:
            text = {**_sparse("text_", self.text.lexical), "text_bias": np.float32(self.text.bias),
                    **_stored("text_", self.text.benign_scores, self.text.benign_groups)}
        np.savez_compressed(path, embedding=self.embedding.astype(np.float16), bias=np.float32(self.bias),
                            **_sparse("", self.lexical), **text,
                            lexical_dim_bits=lexical.DIM_BITS, lexical_orders=np.array(lexical.ORDERS),
                            **_stored("", self.benign_scores, self.benign_groups),
                            **({"last_paragraph": np.bool_(True)} if self.last_paragraph else {}))

    def score(self, vector: np.ndarray | None, text: str) -> float | None:
        """A probability-like score in [0, 1] for a prompt's unit embedding and its text; for a
        prompt without an embedding (vector None), the n-gram model's score (None without one)."""
        if vector is None:
            return None if self.text is None else self.text.score(text)
        full = _logistic(float(vector @ self.embedding) + lexical.score(self.lexical, text) + self.bias)
        if self.last_paragraph and (tail := last_paragraph(text)) is not None:
            # An order appended to a pasted document: the embedding of the whole text reads
            # mostly the document, the n-grams of the last paragraph read the order alone.
            return max(full, self.text.score(tail))
        return full

    def threshold(self, false_alarm_rate: float, embedded: bool = True) -> float | None:
        """The threshold that flags at most a share `false_alarm_rate` of the ordinary
        validation prompts of each group (`threshold_for`), for the full model or
        (embedded=False) the n-gram model (None without one)."""
        if embedded:
            return threshold_for(self.benign_scores, false_alarm_rate, self.benign_groups)
        return None if self.text is None else self.text.threshold(false_alarm_rate)


_loaded: InjectionHead | None = None


def default_head() -> InjectionHead:
    """The packaged head, loaded once."""
    global _loaded
    if _loaded is None:
        _loaded = InjectionHead.load()
    return _loaded
