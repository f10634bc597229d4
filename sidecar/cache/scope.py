"""Cache scopes and keys: a hit never crosses scope.

A `CacheScope` is everything that must be *equal* for a stored answer to be served:

- `tenant`: who asks (sidecar/tenancy.py): each credential is its own scope unless the route
  shares its cache or names a verified tenant header; an anonymous caller is not cached.
- `model`: the model the client asked for (not the one the upstream reported).
- `route`: the route's name, so two routes to different upstreams that use the same model
  name never share answers ("" when the caller does not say).
- `endpoint`: the host (lower-cased) and the path with its query, as Envoy passed them on. One
  route may cover several endpoints whose answers differ: an Azure-style deployment in the
  path picks the model, `?api-version=` the answer's shape, another virtual host another
  upstream under the same route name.
- `context_key`: everything but the last user turn's text (`context_key`), including every
  body field not known to leave the answer alone (`sidecar.openai.chat.ANSWER_NEUTRAL_FIELDS`).
- `params_key`: the sampling settings that change the answer (`params_key`).

`scope.key` is SHA-256 hex over all of them; callers wrap it in a Redis Cluster hash tag
(`{<key>}`) so all of a scope's entries live in one slot.

Exact tier: `exact_key(scope, prompt)` = SHA-256 of scope.key and `exact_text(prompt)`.
`exact_text` changes the prompt only as follows, and only in ways that leave the question
a reader (or a program reading it as code) sees unchanged:

1. `normalize_text` (sidecar/embedding/normalize.py): line breaks unified to "\\n";
   invisible characters removed (controls but TAB/LF, format characters such as zero-width
   spaces, bidi marks, tag characters, variation selectors); superscripts and subscripts
   written out (2³ -> 2^3, never 23); NFKC, which merges compatibility variants (full-width
   forms, ligatures, ① and 1, ½ and 1⁄2, ℌ and H, ㎏ and kg); both ends stripped. The
   semantic tier embeds exactly this text, so the exact tier merges nothing the semantic
   tier would not also match at similarity 1.0.
2. Trailing spaces and tabs at the end of each line are removed. They are invisible and
   mean nothing in prose, Markdown (bar hard breaks) or any common language's syntax.
3. A run of spaces/tabs *inside* a line (after its first visible character), and a single
   tab there, becomes one space. Line breaks and leading indentation are kept, because they
   carry meaning: Python blocks, YAML, Makefile tabs, poems and tables differ by them. Inner
   runs mostly align text ("x  =  1" vs "x = 1").
   What these steps do merge: questions *about* invisible characters or spacing ("why
   does this string have two spaces"), spaces inside quoted strings in code
   (`print("a   b")` and `print("a b")`), tab- and space-separated columns on one line, and
   questions that turn on a compatibility variant (step 1). The semantic tier merges all
   of them anyway (its tokenizer ignores whitespace and sees the normalised text).

No lower-casing: case changes meaning ("US"/"us", "Polish"/"polish", "Turkey"/"turkey",
identifiers in code) and the extra hits are not worth a wrong answer. No punctuation
stripping ("Let's eat, grandma"), no trimming of question marks.

Pure functions; no I/O.
"""
from __future__ import annotations

import functools
import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sidecar.canonical import canonical_digest
from sidecar.openai.chat import ChatRequest
from sidecar.embedding.errors import NothingToEmbed
from sidecar.embedding.normalize import normalize_text
from sidecar.tenancy import TenantSettings, tenant_of

# 2: superscripts and subscripts kept apart in exact keys; 3: the endpoint in the scope, the
# Authorization scheme case-folded.
KEY_VERSION = 3

# Temperature buckets: (upper bound inclusive, label). 0 is greedy decoding and its own
# bucket; an absent temperature is the server's default (1.0 for OpenAI and vLLM unless a
# model's generation config says otherwise), so it is its own bucket too ("default") and
# never shares answers with 0 or with an explicit 1.0.
TEMPERATURE_BUCKETS = ((0.0, "0"), (0.3, "(0,0.3]"), (0.7, "(0.3,0.7]"), (1.0, "(0.7,1]"))
TEMPERATURE_ABOVE = ">1"
TEMPERATURE_DEFAULT = "default"

# Sampling fields that are part of the context rather than of the parameters.
_CONTEXT_SAMPLING = ("response_format",)
# Sampling fields whose own handling is in params_key.
_SPECIAL_PARAMS = ("temperature", "max_tokens", "max_completion_tokens", "n", "stop")
_FLOAT_PARAMS = ("top_p", "presence_penalty", "frequency_penalty")

_TRAILING_BLANKS = re.compile(r"[ \t]+$", re.MULTILINE)
_INNER_BLANKS = re.compile(r"(?<=\S)[ \t]{2,}|(?<=\S)\t")


@dataclass(frozen=True)
class CacheScope:
    tenant: str
    model: str
    context_key: str
    params_key: str
    route: str = ""
    endpoint: str = ""

    @functools.cached_property      # read several times a request
    def key(self) -> str:
        return canonical_digest({"v": KEY_VERSION, "tenant": self.tenant, "model": self.model,
                        "route": self.route, "endpoint": self.endpoint,
                        "context": self.context_key, "params": self.params_key})


# ---------------------------------------------------------------- context and parameters

def context_key(chat: ChatRequest) -> str:
    """SHA-256 hex over all that shapes the answer but the last user turn's text.

    The messages' part is the embedding engine's own context key (split_prompt: every turn
    before and after the last user turn, and that turn minus its text), so the semantic
    index and the scope agree on what "the same conversation" is; added to it: tools,
    tool_choice, response_format and every body field Sluice neither reads nor knows to be
    neutral (ChatRequest.other: vLLM's guided decoding, legacy functions, ...). Raises
    ValueError (NothingToEmbed) when there is no user text; `cache_decision` bypasses such
    requests first ("not_text").
    """
    parts = chat.prompt_parts
    if parts is None:
        raise NothingToEmbed("no user message text")
    messages_key = parts.context_key
    context = {"v": KEY_VERSION, "messages": messages_key, "tools": list(chat.tools),
               "tool_choice": chat.tool_choice, **{name: chat.sampling.get(name) for name in _CONTEXT_SAMPLING}}
    if chat.other:          # only when sent, as most requests send none
        context["other"] = dict(chat.other)
    return canonical_digest(context)


def temperature_bucket(temperature: float | None) -> str:
    if temperature is None:
        return TEMPERATURE_DEFAULT
    for upper, label in TEMPERATURE_BUCKETS:
        if temperature <= upper:
            return label
    return TEMPERATURE_ABOVE


def params_key(chat: ChatRequest) -> str:
    """SHA-256 hex over the sampling settings, made canonical where two spellings mean one
    thing and exact everywhere else:

    - temperature: its bucket (`temperature_bucket`);
    - max_tokens / max_completion_tokens: one value, max_completion_tokens winning (as
      ChatRequest.max_tokens reads them);
    - n: absent is 1;
    - stop: a string is a one-element list; order and repeats do not matter;
    - top_p and the penalties: as floats (1 and 1.0 are one value);
    - seed, logit_bias (keys sorted), logprobs, top_logprobs, reasoning_effort and any
      other field ChatRequest keeps: as sent. An absent field is not its default (top_p
      absent is not top_p 1.0): a miss, never a wrong hit.
    response_format is in `context_key`.
    """
    sampling = chat.sampling
    params: dict[str, Any] = {name: value for name, value in sampling.items()
                              if name not in _SPECIAL_PARAMS and name not in _CONTEXT_SAMPLING}
    for name in _FLOAT_PARAMS:
        if name in params:
            params[name] = float(params[name])
    stop = sampling.get("stop")
    if stop is not None:
        params["stop"] = sorted({stop} if isinstance(stop, str) else set(stop))
    params["temperature"] = temperature_bucket(sampling.get("temperature"))
    params["max_tokens"] = chat.max_tokens
    params["n"] = sampling.get("n", 1)
    return canonical_digest({"v": KEY_VERSION, **params})


def scope_for(chat: ChatRequest, headers: Mapping[str, str], policy: TenantSettings,
              secret: bytes, route: str = "") -> CacheScope | None:
    """The request's scope; None for an anonymous caller (see module doc)."""
    tenant = tenant_of(headers, secret, tenant_header=policy.tenant_header, shared=policy.shared)
    if tenant is None:
        return None
    return CacheScope(tenant=tenant, model=chat.model, context_key=context_key(chat),
                      params_key=params_key(chat), route=route, endpoint=endpoint_of(headers))


def endpoint_of(headers: Mapping[str, str]) -> str:
    """The host and the path with its query, as one string (see the module doc)."""
    return (headers.get(":authority") or "").lower() + " " + (headers.get(":path") or "")


# ---------------------------------------------------------------- prompt and exact key

def prompt_text(chat: ChatRequest) -> str:
    """The last user turn's text, raw: what the cache compares ("" when there is none)."""
    parts = chat.prompt_parts
    return "" if parts is None else parts.text


def exact_text(prompt: str) -> str:
    """The prompt as the exact tier keys it (see the module doc for each step)."""
    text = normalize_text(prompt)
    # The substitutions cost ~100 µs on a 2 KB prompt: run them only where they can match
    # (normalize_text already stripped both ends).
    if " \n" in text or "\t\n" in text:
        text = _TRAILING_BLANKS.sub("", text)
    if "  " in text or "\t" in text:
        text = _INNER_BLANKS.sub(" ", text)
    return text


def exact_key(scope: CacheScope, prompt: str) -> str:
    """SHA-256 hex of the scope key and the exact-tier text of the prompt."""
    return exact_key_in(scope.key, prompt)


def exact_key_in(scope_key: str, prompt: str) -> str:
    """exact_key for a scope known by its key alone (an operator's report names it)."""
    material = scope_key + "\n" + exact_text(prompt)
    return hashlib.sha256(material.encode("utf-8", "surrogatepass")).hexdigest()
