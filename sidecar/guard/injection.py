"""Prompt-injection classifier: one logistic model over the prompt's MiniLM embedding and its
hashed character n-grams.

The sidecar already embeds the last user turn for the semantic cache; the classifier reads that
vector (no second model run) and the text itself (sidecar/guard/lexical.py: the words that make
an order out of a question, which the embedding blurs). Trained by scripts/train_guard.py on
data/guard/ and ../shared/data (its README). The weights file also holds the scores the
classifier gave benign validation prompts, so a route's threshold is set as the share of
ordinary prompts it may flag (`false_alarm_rate`), the unit an operator reasons in.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from sidecar.guard import lexical

WEIGHTS = Path(__file__).with_name("injection_head.npz")
DEFAULT_FALSE_ALARM_RATE = 0.001


@dataclass(frozen=True)
class InjectionHead:
    embedding: np.ndarray       # [dim] weights of the unit embedding
    lexical: np.ndarray         # [lexical.DIM] weights of the n-gram buckets
    bias: float
    benign_scores: np.ndarray   # sorted scores of benign validation prompts (calibration)

    @classmethod
    def load(cls, path: Path = WEIGHTS) -> "InjectionHead":
        with np.load(path) as data:
            if int(data["lexical_dim_bits"]) != lexical.DIM_BITS or tuple(data["lexical_orders"]) != lexical.ORDERS:
                raise ValueError(f"{path} was trained with other lexical features: run `make guard-model`")
            weights = np.zeros(lexical.DIM, np.float32)
            weights[data["lexical_index"]] = data["lexical_weight"].astype(np.float32)
            return cls(data["embedding"].astype(np.float32), weights, float(data["bias"]),
                       np.sort(data["benign_scores"].astype(np.float32)))

    def save(self, path: Path) -> None:
        used = np.flatnonzero(self.lexical)     # most buckets never occur in training: stored sparse
        np.savez_compressed(path, embedding=self.embedding.astype(np.float16), bias=np.float32(self.bias),
                            lexical_index=used.astype(np.int32), lexical_weight=self.lexical[used].astype(np.float16),
                            lexical_dim_bits=lexical.DIM_BITS, lexical_orders=np.array(lexical.ORDERS),
                            benign_scores=self.benign_scores.astype(np.float32))

    def score(self, vector: np.ndarray, text: str) -> float:
        """A probability-like score in [0, 1] for a prompt's unit embedding and its text."""
        logit = float(vector @ self.embedding) + lexical.score(self.lexical, text) + self.bias
        return 0.5 * (1.0 + math.tanh(logit / 2))     # the logistic function, without overflow

    def threshold(self, false_alarm_rate: float) -> float:
        """The score above which a share `false_alarm_rate` of benign validation prompts lie."""
        if not 0.0 < false_alarm_rate < 1.0:
            raise ValueError(f"false_alarm_rate must be in (0, 1), got {false_alarm_rate}")
        return float(np.quantile(self.benign_scores, 1.0 - false_alarm_rate, method="higher"))


_loaded: InjectionHead | None = None


def default_head() -> InjectionHead:
    """The packaged head, loaded once."""
    global _loaded
    if _loaded is None:
        _loaded = InjectionHead.load()
    return _loaded
