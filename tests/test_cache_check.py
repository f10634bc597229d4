"""`sluice cache-check` runs the server's decision code on pairs of prompts."""
import json
import subprocess

from devtools.stack import BIN, ROOT

PAIRS = [
    {"a": "How do I reset my password?", "b": "How do I reset my password?"},
    {"a": "How do I reset my password?", "b": "how can I reset my password?"},
    {"a": "How do I convert celsius to fahrenheit?", "b": "How do I convert fahrenheit to celsius?"},
    {"a": "Who won the match today?", "b": "Who won the match today?"},
    {"a": "What is an API?", "b": "What is the capital of France?"},
]


def run(pairs, *args):
    stdin = "".join(json.dumps(p) + "\n" for p in pairs) + "not json\n"
    result = subprocess.run([str(BIN / "sluice"), "cache-check", *args], input=stdin, capture_output=True,
                            text=True, cwd=ROOT, timeout=120)
    assert result.returncode == 0, result.stderr
    return [json.loads(line) for line in result.stdout.splitlines()]


def test_decisions_with_the_reason_that_decided():
    exact, semantic, swapped, time_sensitive, unrelated, bad = run(PAIRS)
    assert exact == {"hit": True, "tier": "exact", "similarity": 1.0, "reason": "exact"}
    assert semantic["hit"] and semantic["tier"] == "semantic" and semantic["similarity"] >= 0.94
    assert not swapped["hit"] and swapped["reason"] in ("order_differs", "below_threshold")
    assert time_sensitive == {"hit": False, "tier": None, "similarity": None, "reason": "a_not_stored:time_sensitive"}
    assert not unrelated["hit"] and unrelated["reason"] == "below_threshold" and unrelated["similarity"] < 0.5
    assert "error" in bad


def test_route_settings_apply():
    off, = run(PAIRS[1:2], "--route", json.dumps({"cache": {"semantic": False}}))[:1]
    assert off == {"hit": False, "tier": None, "similarity": None, "reason": "no_semantic_tier"}
    bad = subprocess.run([str(BIN / "sluice"), "cache-check", "--route", '{"cache": {"ttl_s": "x"}}'],
                         input="", capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert bad.returncode == 2 and "ttl_s" in bad.stderr.lower() + bad.stderr
