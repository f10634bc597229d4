"""Prompt-injection classifier: a small head over the prompt's MiniLM embedding.

The sidecar already embeds the last user turn for the semantic cache; this head reads that
vector (no second model run): a one-hidden-layer MLP in numpy, trained by
scripts/train_guard.py on data/guard/ and ../shared/data (its README). The weights file also
holds the scores the head gave benign validation prompts, so a route's threshold is set as the
share of ordinary prompts it may flag (`false_alarm_rate`), the unit an operator reasons in.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

WEIGHTS = Path(__file__).with_name("injection_head.npz")
DEFAULT_FALSE_ALARM_RATE = 0.01


@dataclass(frozen=True)
class InjectionHead:
    w1: np.ndarray          # [dim, hidden]
    b1: np.ndarray          # [hidden]
    w2: np.ndarray          # [hidden]
    b2: float
    benign_scores: np.ndarray   # sorted scores of benign validation prompts (calibration)

    @classmethod
    def load(cls, path: Path = WEIGHTS) -> "InjectionHead":
        with np.load(path) as data:
            return cls(data["w1"].astype(np.float32), data["b1"].astype(np.float32),
                       data["w2"].astype(np.float32), float(data["b2"]),
                       np.sort(data["benign_scores"].astype(np.float32)))

    def scores(self, vectors: np.ndarray) -> np.ndarray:
        """Probability-like scores in [0, 1] for unit vectors [n, dim]."""
        hidden = np.maximum(vectors @ self.w1 + self.b1, 0.0)
        return 1.0 / (1.0 + np.exp(-(hidden @ self.w2 + self.b2)))

    def score(self, vector: np.ndarray) -> float:
        return float(self.scores(vector[None, :])[0])

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
