"""Prometheus metrics of the guard: what it found, per route, detector and action (never text)."""
from __future__ import annotations

from prometheus_client import Counter, Histogram

FINDINGS = Counter(
    "sluice_guard_findings_total",
    "Requests in which the guard found something, by route, detector (word, email, phone, card, iban, "
    "ip, secret, private_key, injection) and the action taken (block, mask, redact, flag).",
    ["route", "detector", "action"])
UNCHECKED = Counter(
    "sluice_guard_unchecked_total",
    "Requests the injection classifier could not check (no user text, or no embedding and no n-gram "
    "model); they pass. By route and reason.",
    ["route", "reason"])
TEXT_ONLY = Counter(
    "sluice_guard_text_only_total",
    "Requests the injection classifier judged by their character n-grams alone, without an embedding "
    "(NothingToEmbed: text the model's vocabulary lacks; QueueFull; no_model). By route and reason.",
    ["route", "reason"])
SECONDS = Histogram(
    "sluice_guard_seconds", "Guard time per request, words and personal data (not the embedding).",
    buckets=(0.00005, 0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.05))
