"""The guard's decision on one chat request: pure functions over its messages and policy.

`scan` runs the word lists and personal-data detectors over the checked messages and returns
the findings, the rule that blocks (if any) and the rewritten texts (masks and typed
placeholders). `judge_injection` turns the classifier's score into a finding. No text the
guard found is kept in what they return, only detector names, actions and scores.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, replace

from sidecar.guard import pii as pii_detectors
from sidecar.guard.policy import GuardPolicy

MASK = "***"
_CHECKED_ROLES = {"last_user": ("user",), "user": ("user",), "user_and_system": ("user", "system", "developer")}


@dataclass(frozen=True)
class Finding:
    detector: str      # word | email | phone | card | iban | ip | secret | private_key | injection
    action: str        # block | mask | redact | flag
    rule: str          # the word list's name, else the detector's
    score: float = 1.0
    count: int = 1


@dataclass
class Scan:
    findings: list[Finding] = field(default_factory=list)
    # (message index, part index or None) -> the text the upstream gets instead
    rewrites: dict[tuple[int, int | None], str] = field(default_factory=dict)

    @property
    def blocking(self) -> Finding | None:
        return next((f for f in self.findings if f.action == "block"), None)


def checked_texts(messages, scope: str) -> list[tuple[tuple[int, int | None], str]]:
    """The texts the policy checks, each with where it sits: (message, text part or None)."""
    roles = _CHECKED_ROLES[scope]
    indices = [i for i, m in enumerate(messages) if m.get("role") in roles]
    if scope == "last_user":
        indices = indices[-1:]
    out = []
    for i in indices:
        content = messages[i].get("content")
        if isinstance(content, str):
            out.append(((i, None), content))
        elif isinstance(content, list):
            out.extend(((i, j), part["text"]) for j, part in enumerate(content)
                       if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str))
    return out


def scan(policy: GuardPolicy, messages) -> Scan:
    result = Scan()
    texts = checked_texts(messages, policy.messages)
    word_hits: dict[int, int] = {}
    pii_hits: dict[str, int] = {}
    placeholders: dict[tuple[str, str], str] = {}
    numbered: dict[str, int] = {}               # placeholders per detector
    phones = pii_detectors.PhoneVerdicts()      # one budget of phone-number parses for all the texts
    for where, text in texts:
        edits: list[tuple[int, int, str]] = []
        if policy.words is not None:
            found = policy.words.find(text)
            for index in found.lists:
                word_hits[index] = word_hits.get(index, 0) + 1
            masked = {i for i in found.lists if policy.word_rules[i].action == "mask"}
            if masked:
                edits += [(s, e, MASK) for s, e in policy.words.spans(text, masked, found)]
        if policy.pii:
            for span in pii_detectors.find(text, policy.pii, policy.pii_settings, phones=phones):
                pii_hits[span.detector] = pii_hits.get(span.detector, 0) + 1
                if policy.pii[span.detector] == "redact":
                    value = text[span.start:span.end]
                    key = (span.detector, value)
                    if key not in placeholders:
                        # Counted per detector, not by reading every placeholder so far: a text
                        # of many distinct values would cost quadratic time.
                        n = numbered[span.detector] = numbered.get(span.detector, 0) + 1
                        placeholders[key] = f"<{span.detector.upper()}_{n}>"
                    edits.append((span.start, span.end, placeholders[key]))
        if edits:
            result.rewrites[where] = _apply(text, edits)
    for index, count in sorted(word_hits.items()):
        rule = policy.word_rules[index]
        result.findings.append(Finding("word", rule.action, rule.name, count=count))
    for detector, count in pii_hits.items():
        result.findings.append(Finding(detector, policy.pii[detector], detector, count=count))
    return result


def scrubbing(policy: GuardPolicy) -> GuardPolicy:
    """The policy with every `block` turned into a rewrite: what a blocked request's record
    (the request log with log_prompts on) keeps instead of the text that blocked it."""
    rules = tuple(replace(r, action="mask") if r.action == "block" else r for r in policy.word_rules)
    pii = {name: "redact" if action == "block" else action for name, action in policy.pii.items()}
    return replace(policy, word_rules=rules, pii=pii)


def _apply(text: str, edits: list[tuple[int, int, str]]) -> str:
    out, at = [], 0
    for start, end, replacement in sorted(edits):
        if start < at:             # overlaps an earlier edit (a masked word inside an e-mail)
            if end > at:
                at = end
            continue
        out.append(text[at:start])
        out.append(replacement)
        at = end
    out.append(text[at:])
    return "".join(out)


def judge_injection(policy: GuardPolicy, score: float | None, *, embedded: bool) -> Finding | None:
    """A finding when `score` reaches the route's threshold: the full model's, or (embedded=False)
    the n-gram model's for a prompt without an embedding. No score (no model): no finding.
    `embedded` has no default: the caller says which model gave the score, so the two models'
    scores and thresholds cannot be mixed."""
    rule = policy.injection
    threshold = None if rule is None else rule.threshold if embedded else rule.text_threshold
    if score is None or threshold is None or score < threshold:
        return None
    return Finding("injection", rule.action, "injection", round(score, 4))


def rewrite_body(body: bytes, rewrites: dict[tuple[int, int | None], str]) -> bytes:
    """The request body with the rewritten texts in place; everything else as it was."""
    from sidecar.cache.answer import compact_json
    data = json.loads(body)
    for (message, part), text in rewrites.items():
        if part is None:
            data["messages"][message]["content"] = text
        else:
            data["messages"][message]["content"][part]["text"] = text
    return compact_json(data)


def header_value(findings: list[Finding]) -> str:
    """x-sluice-guard: what passed flagged or rewritten, as `detector:rule=action`, no text."""
    return ",".join(f"{f.detector}:{f.rule}={f.action}" if f.detector == "word" else
                    f"{f.detector}={f.action}" + (f";score={f.score}" if f.detector == "injection" else "")
                    for f in findings)
