"""`sluice guard-check`: the guard on your own prompts, without Envoy.

Reads JSON lines {"text": ...} on stdin and writes one line per input:
{"blocked": bool, "findings": [{"detector": ..., "action": "block", "score": ...}]}, with every
detector on at its default threshold and action block (word lists only when given with
--words). Nothing of the text is written back.
"""
from __future__ import annotations

import argparse
import json
import sys

from sidecar.guard.injection import DEFAULT_FALSE_ALARM_RATE
from sidecar.guard.pii import DETECTORS


def add_subcommands(commands) -> None:
    parser = commands.add_parser("guard-check", help="run the guard's detectors on JSON lines from stdin")
    parser.add_argument("--words", action="append", default=[], metavar="FILE",
                        help="a denied-word file (one per line), checked as a list named after it; repeatable")
    parser.add_argument("--no-injection", action="store_true",
                        help="skip the injection classifier (it loads the embedding model)")
    parser.add_argument("--false-alarm-rate", type=float, default=DEFAULT_FALSE_ALARM_RATE,
                        help=f"the injection classifier's share of ordinary prompts flagged (default {DEFAULT_FALSE_ALARM_RATE})")
    parser.set_defaults(func=_run)


def _policy(args):
    from sidecar.guard.policy import build_policy
    from sidecar.protos import route_settings_pb2
    guard = route_settings_pb2.Guard()
    for path in args.words:
        guard.words.add(name=path.rsplit("/", 1)[-1], file=path, action="block")
    for name in DETECTORS:
        guard.personal_data.detectors[name] = "block"
    if not args.no_injection:
        guard.injection.enabled = True
        guard.injection.false_alarm_rate = args.false_alarm_rate
    return build_policy(guard)


def _run(args: argparse.Namespace) -> int:
    from sidecar.guard.check import judge_injection, scan
    try:
        policy = _policy(args)
    except ValueError as exc:
        print(f"sluice guard-check: {exc}", file=sys.stderr)
        return 2
    encoder = head = None
    if policy.injection is not None:
        from sidecar.embedding import EmbeddingSettings
        from sidecar.embedding.loader import load
        from sidecar.guard.injection import default_head
        encoder, head = load(EmbeddingSettings.from_env()).encoder, default_head()
    for number, line in enumerate(sys.stdin, 1):
        if not line.strip():
            continue
        try:
            text = json.loads(line)["text"]
            if not isinstance(text, str):
                raise TypeError
        except (ValueError, KeyError, TypeError):
            print(f"sluice guard-check: line {number} is not a JSON object with a string 'text'", file=sys.stderr)
            print(json.dumps({"error": "expected {\"text\": string}"}), flush=True)
            continue
        findings = scan(policy, [{"role": "user", "content": text}]).findings
        if encoder is not None:
            from sidecar.embedding.errors import NothingToEmbed
            try:
                finding = judge_injection(policy, head.score(encoder.embed([text])[0], text), embedded=True)
            except NothingToEmbed:      # text the model's vocabulary lacks: the n-gram model
                finding = judge_injection(policy, head.score(None, text), embedded=False)
            if finding is not None:
                findings.append(finding)
        print(json.dumps({"blocked": any(f.action == "block" for f in findings),
                          "findings": [{"detector": f.detector, "action": f.action, "score": f.score}
                                       for f in findings]}), flush=True)
    return 0
