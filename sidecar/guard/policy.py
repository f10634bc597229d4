"""A route's guard settings (proto sluice.v1.Guard) as a validated, compiled policy.

Built once per route settings object (and again after SIGHUP, which re-reads word files);
a bad value raises ValueError naming the field.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from sidecar.guard.injection import DEFAULT_FALSE_ALARM_RATE
from sidecar.guard.normalize import prepare_offsets
from sidecar.guard.pii import DETECTORS, DEFAULT_MIN_ENTROPY, DEFAULT_PHONE_REGIONS, GROUPED_PHONE_REGIONS, PiiSettings
from sidecar.guard.pii import prepare as prepare_phones
from sidecar.guard.pii import prepare_tables as prepare_pii_tables
from sidecar.guard.words import WordMatcher

MESSAGE_SCOPES = ("last_user", "user", "user_and_system")
WORD_ACTIONS = ("block", "mask", "flag")
PII_ACTIONS = ("block", "redact", "flag")
INJECTION_ACTIONS = ("block", "flag")


@dataclass(frozen=True)
class WordRule:
    name: str
    action: str


@dataclass(frozen=True)
class InjectionRule:
    action: str
    threshold: float
    false_alarm_rate: float
    text_threshold: float | None = None    # the n-gram model's, for prompts without an embedding


@dataclass(frozen=True)
class GuardPolicy:
    messages: str = "last_user"
    word_rules: tuple[WordRule, ...] = ()
    words: WordMatcher | None = None
    pii: dict[str, str] = field(default_factory=dict)      # detector -> action
    pii_settings: PiiSettings = PiiSettings()
    injection: InjectionRule | None = None


def read_word_file(path: str) -> list[str]:
    words = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            words.append(line)
    return words


def _choice(value: str, allowed: tuple[str, ...], where: str, default: str) -> str:
    value = (value or default).lower()
    if value not in allowed:
        raise ValueError(f"guard.{where} must be one of {', '.join(allowed)}, not {value!r}")
    return value


def build_policy(guard, injection_head=None) -> GuardPolicy | None:
    """The compiled policy of a sluice.v1.Guard message; None when it checks nothing.
    injection_head: sidecar.guard.injection.InjectionHead (needed when injection is on)."""
    messages = _choice(guard.messages, MESSAGE_SCOPES, "messages", "last_user")
    rules, lists = [], []
    for index, spec in enumerate(guard.words):
        where = f"words[{index}]"
        words = list(spec.words)
        if spec.file:
            try:
                words += read_word_file(spec.file)
            except (OSError, UnicodeDecodeError) as exc:
                raise ValueError(f"guard.{where}.file {spec.file!r} cannot be read: {exc}") from None
        rules.append(WordRule(spec.name or "words", _choice(spec.action, WORD_ACTIONS, f"{where}.action", "block")))
        lists.append((words, _choice(spec.squeeze, ("cjk", "all", "off"), f"{where}.squeeze", "cjk")))
    pii = {}
    data = guard.personal_data
    for name, action in data.detectors.items():
        if name not in DETECTORS:
            raise ValueError(f"guard.personal_data.detectors has no detector {name!r} (known: {', '.join(DETECTORS)})")
        pii[name] = _choice(action, PII_ACTIONS, f"personal_data.detectors[{name}]", "block")
    regions = tuple(r.upper() for r in data.phone_regions) or DEFAULT_PHONE_REGIONS
    # Regions a route names are all it wants; without them, grouped numbers of more regions count.
    grouped = () if data.phone_regions else GROUPED_PHONE_REGIONS
    entropy = data.min_secret_entropy if data.HasField("min_secret_entropy") else DEFAULT_MIN_ENTROPY
    if not 0 < entropy <= 7:
        raise ValueError(f"guard.personal_data.min_secret_entropy must be in (0, 7], got {entropy}")
    injection = None
    if guard.injection.enabled:
        spec = guard.injection
        rate = spec.false_alarm_rate if spec.HasField("false_alarm_rate") else DEFAULT_FALSE_ALARM_RATE
        if injection_head is None:
            from sidecar.guard.injection import default_head
            injection_head = default_head()
        try:
            threshold = injection_head.threshold(rate)
            text_threshold = injection_head.threshold(rate, embedded=False)
        except ValueError as exc:
            raise ValueError(f"guard.injection.{exc}") from None
        injection = InjectionRule(_choice(spec.action, INJECTION_ACTIONS, "injection.action", "block"),
                                  threshold, rate, text_threshold)
    if not rules and not pii and injection is None:
        return None
    # The folding tables (~0.1 s), the detectors' character table and the phone regions' rules
    # are loaded now, not on the first request that needs them.
    prepare_offsets()
    if pii:
        prepare_pii_tables()
    if "phone" in pii:
        prepare_phones(regions + grouped)
    return GuardPolicy(messages, tuple(rules), WordMatcher(lists) if rules else None, pii,
                       PiiSettings(regions, entropy, grouped), injection)
