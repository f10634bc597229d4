"""Per-route cache policy and the decision whether one request may use the cache.

`cache_decision(chat, headers, policy)` returns None when the request may be served from
the cache and its answer stored, or a `Bypass` naming the first rule that said no
(`reason`, a short label for metrics and logs) and whether the upstream's answer may
still be stored (`may_store`; `may_serve` is always False on a Bypass).

Rules, in order (first match names the reason):

| reason         | when                                                        | may_store |
|----------------|-------------------------------------------------------------|-----------|
| disabled       | policy.enabled is False                                     | no        |
| no_store       | request Cache-Control: no-store                             | no        |
| anonymous      | no credential and the route is not shared (see scope.py)    | no        |
| n_gt_1         | n > 1: a stored answer is one choice                        | no        |
| logprobs       | logprobs requested: a stored answer has none                | no        |
| tools          | tools (or legacy functions) sent and not policy.allow_tools  | no        |
| temperature    | temperature (absent: 1.0) > policy.max_temperature          | no        |
| not_text       | the last user turn has no visible text                      | no        |
| time_sensitive | the last user turn names a time ("today", "latest", ...)    | no        |
| no_cache       | Cache-Control: no-cache or max-age=0, or Pragma: no-cache   | yes       |

no-cache vs no-store follow HTTP (RFC 9111 §5.2.1): `no-cache` asks that a stored answer
not be *used* without going to the origin; it does not forbid storing the fresh one, so
the request goes upstream and its answer refreshes the cache (may_store). `no-store` asks
that nothing of the request or its response be stored. no_cache is checked last so that
any rule that forbids storing wins over it. Cache-Control directives are matched
case-insensitively in any order, with or without values (RFC 9110 list syntax).

Time-sensitive words match the normalised last user turn (sidecar/embedding/normalize.py:
NFKC, invisibles removed) case-insensitively: on word boundaries for scripts that put
spaces between words, as a substring for Chinese, Japanese and Korean, where words are not
separated by spaces (and Korean particles attach to the word). A false match costs a
cache hit; a missed one can serve yesterday's news, so the list leans broad, but leaves
out words that are common in another sense in another language of the list (Spanish
"actual" is English "actual", French "hier" is German "here", Italian "ora" is also
"hour"), single words that mostly mean something else ("último", "dernières": "last" of a
list; they enter as "últimas noticias", "dernières nouvelles") and kana that occur inside
common words (Japanese "いま" is in every "〜います").

Pure functions; no I/O.
"""
from __future__ import annotations

import functools
import math
import re
from typing import NamedTuple
from collections.abc import Mapping
from dataclasses import dataclass

from sidecar.cache.equivalence import DEFAULT_MAX_FALSE_HIT_RATE
from sidecar.cache.scope import prompt_text
from sidecar.openai.chat import ChatRequest
from sidecar.embedding.normalize import normalize_text
from sidecar.tenancy import credential

TIME_SENSITIVE_WORDS: tuple[str, ...] = (
    # English
    "today", "tonight", "now", "right now", "nowadays", "currently", "current", "latest",
    "recent", "recently", "yesterday", "tomorrow", "this morning", "this afternoon",
    "this evening", "this week", "this weekend", "this month", "this year", "last week",
    "next week", "breaking", "at the moment", "so far", "up to date", "up-to-date",
    # German
    "heute", "gestern", "morgen", "jetzt", "aktuell", "aktuelle", "aktuellen", "aktueller",
    "aktuelles", "derzeit", "neueste", "neuesten", "diese woche",
    # French
    "aujourd'hui", "maintenant", "actuel", "actuelle", "actuellement", "demain",
    "en ce moment", "cette semaine", "dernières nouvelles",
    # Spanish
    "hoy", "ahora", "actualmente", "ayer", "mañana", "esta semana", "últimas noticias",
    # Portuguese
    "hoje", "agora", "atual", "atualmente", "ontem", "amanhã",
    # Italian
    "oggi", "adesso", "attuale", "attualmente", "ieri", "domani",
    # Russian
    "сегодня", "сейчас", "вчера", "завтра", "текущий", "последние новости",
    # Chinese (simplified and traditional)
    "今天", "今晚", "今年", "最新", "现在", "現在", "目前", "刚刚", "剛剛", "昨天", "明天",
    "本周", "这周", "這週", "最近", "当前", "當前", "实时", "即時",
    # Japanese
    "今日", "今週", "昨日", "明日",
    # Korean
    "오늘", "지금", "최신", "현재", "어제", "내일", "요즘",
)

_CJK = re.compile("[\u1100-\u11ff\u3040-\u30ff\u3130-\u318f\u3400-\u4dbf\u4e00-\u9fff"
                  "\uac00-\ud7af\uf900-\ufaff]")


@dataclass(frozen=True)
class CachePolicy:
    enabled: bool = True
    semantic_threshold: float = 0.93       # τ: minimum cosine; tuned in docs/semantic-checks.md
    # Target false-hit rate of the learned verifier (0: off, τ and the checks decide);
    # the default is measured in docs/semantic-quality.md.
    max_false_hit_rate: float = DEFAULT_MAX_FALSE_HIT_RATE
    ttl_s: float = 86400.0
    allow_tools: bool = False
    max_temperature: float = 1.0
    shared: bool = False                   # one cache for all tenants of this route
    tenant_header: str = ""                # header Envoy sets from a verified identity
    time_sensitive_words: tuple[str, ...] = TIME_SENSITIVE_WORDS
    dedup: bool = True                     # coalesce identical in-flight requests
    max_dedup_wait_s: float = 30.0

    def __post_init__(self) -> None:
        for name in ("enabled", "allow_tools", "shared", "dedup"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: must be a boolean, got {getattr(self, name)!r}")
        _check_number("semantic_threshold", self.semantic_threshold)
        if not 0.0 < self.semantic_threshold <= 1.0:
            raise ValueError(f"semantic_threshold: must be in (0, 1], got {self.semantic_threshold!r}")
        _check_number("max_false_hit_rate", self.max_false_hit_rate)
        if not 0.0 <= self.max_false_hit_rate < 1.0:
            raise ValueError(f"max_false_hit_rate: must be in [0, 1), got {self.max_false_hit_rate!r}")
        _check_number("ttl_s", self.ttl_s)
        if self.ttl_s <= 0:
            raise ValueError(f"ttl_s: must be > 0, got {self.ttl_s!r}")
        _check_number("max_temperature", self.max_temperature)
        if self.max_temperature < 0:
            raise ValueError(f"max_temperature: must be >= 0, got {self.max_temperature!r}")
        _check_number("max_dedup_wait_s", self.max_dedup_wait_s)
        if self.max_dedup_wait_s < 0:
            raise ValueError(f"max_dedup_wait_s: must be >= 0, got {self.max_dedup_wait_s!r}")
        if not isinstance(self.tenant_header, str) or (
                self.tenant_header and not re.fullmatch(r"[a-z0-9!#$%&'*+.^_`|~-]+", self.tenant_header)):
            raise ValueError(f"tenant_header: must be a lower-case header name, got {self.tenant_header!r}")
        words = self.time_sensitive_words
        if isinstance(words, list):
            words = tuple(words)
            object.__setattr__(self, "time_sensitive_words", words)
        if not isinstance(words, tuple) or not all(isinstance(w, str) and w.strip() for w in words):
            raise ValueError("time_sensitive_words: must be a tuple of non-empty strings")


def _check_number(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name}: must be a finite number, got {value!r}")


@dataclass(frozen=True)
class Bypass:
    reason: str
    may_store: bool = False

    @property
    def may_serve(self) -> bool:
        return False


# ---------------------------------------------------------------- Cache-Control

def cache_directives(headers: Mapping[str, str]) -> dict[str, str | None]:
    """Request Cache-Control directives, lower-cased name -> value (None without one).
    `Pragma: no-cache` counts as `no-cache` when there is no Cache-Control (RFC 9111 §5.4)."""
    directives: dict[str, str | None] = {}
    for item in (headers.get("cache-control") or "").split(","):
        name, sep, value = item.strip().partition("=")
        name = name.strip().lower()
        if name:
            directives[name] = value.strip().strip('"') if sep else None
    if not directives and "no-cache" in (headers.get("pragma") or "").lower():
        directives["no-cache"] = None
    return directives


def _no_cache(directives: Mapping[str, str | None]) -> bool:
    return "no-cache" in directives or directives.get("max-age") == "0"


# ---------------------------------------------------------------- time-sensitive words

_TOKEN = re.compile(r"\w+")
# ASCII text: every non-word character to a space, then split (4x faster than _TOKEN.findall).
_ASCII_NON_WORD = str.maketrans({chr(c): " " for c in range(128) if not _TOKEN.fullmatch(chr(c))})


class _TimeWords(NamedTuple):
    pattern: re.Pattern[str]    # every entry: Latin-script ones word-bounded, CJK ones anywhere
    firsts: frozenset[str]      # the lower-case first token of every word-bounded entry
    bare: tuple[str, ...]       # the CJK entries


@functools.lru_cache(maxsize=64)
def _time_words(words: tuple[str, ...]) -> _TimeWords:
    # One word-boundary group around all Latin-script words (not one per word: the engine would
    # try ~150 lookbehinds at every position, 2.6 ms on a 2 KB prompt instead of ~0.4 ms).
    bounded, bare_bodies, firsts, bare = [], [], set(), []
    for word in sorted({normalize_text(w).lower() for w in words}, key=len, reverse=True):
        body = r"\s+".join(re.escape(part).replace("'", "['\u2019]") for part in word.split())
        if _CJK.search(word):
            bare_bodies.append(body)
            bare.append(word)
        else:
            bounded.append(body)
            firsts.add(_TOKEN.findall(word)[0])
    alternatives = ([rf"(?<!\w)(?:{'|'.join(bounded)})(?!\w)"] if bounded else []) + bare_bodies
    return _TimeWords(re.compile("|".join(alternatives), re.IGNORECASE), frozenset(firsts), tuple(bare))


def _tokens(lower: str) -> list[str]:
    return lower.translate(_ASCII_NON_WORD).split() if lower.isascii() else _TOKEN.findall(lower)


def time_sensitive_word(text: str, words: tuple[str, ...] = TIME_SENSITIVE_WORDS) -> str | None:
    """The first time-sensitive word in the text (as in its normalised form); None if none.

    Most prompts have none: a prompt without any entry's first word and without a CJK entry
    cannot match, and a set lookup says so before the pattern (an alternation of ~150 words
    tried at every position: ~0.4 ms on a 2 KB prompt) runs."""
    if not words:
        return None
    normal = normalize_text(text)
    time_words = _time_words(words)
    lower = normal.lower()
    if time_words.firsts.isdisjoint(_tokens(lower)) and not any(word in lower for word in time_words.bare):
        return None
    match = time_words.pattern.search(normal)
    return match.group(0) if match else None


# ---------------------------------------------------------------- decision

def cache_decision(chat: ChatRequest, headers: Mapping[str, str],
                   policy: CachePolicy) -> Bypass | None:
    """None: serve from the cache and store the answer; else why not (module doc)."""
    if not policy.enabled:
        return Bypass("disabled")
    directives = cache_directives(headers)
    if "no-store" in directives:
        return Bypass("no_store")
    if not policy.shared and credential(headers, policy.tenant_header) is None:
        return Bypass("anonymous")
    sampling = chat.sampling
    if sampling.get("n", 1) > 1:
        return Bypass("n_gt_1")
    if sampling.get("logprobs") or sampling.get("top_logprobs"):
        return Bypass("logprobs")
    if chat.uses_tools and not policy.allow_tools:
        return Bypass("tools")
    if sampling.get("temperature", 1.0) > policy.max_temperature:
        return Bypass("temperature")
    text = prompt_text(chat)
    if not normalize_text(text):
        return Bypass("not_text")
    if time_sensitive_word(text, policy.time_sensitive_words):
        return Bypass("time_sensitive")
    if _no_cache(directives):
        return Bypass("no_cache", may_store=True)
    return None
