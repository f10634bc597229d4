"""`sluice cache-check` runs the server's decision code on pairs of prompts."""
import json
import subprocess

from devtools import envoy_config
from devtools.stack import BIN, ROOT, inherited_env

PAIRS = [
    {"a": "How do I reset my password?", "b": "How do I reset my password?"},
    {"a": "How do I reset my password?", "b": "how can I reset my password?"},
    {"a": "How do I convert celsius to fahrenheit?", "b": "How do I convert fahrenheit to celsius?"},
    {"a": "Who won the match today?", "b": "Who won the match today?"},
    {"a": "What is an API?", "b": "What is the capital of France?"},
]


def check(pairs, *args, **env) -> subprocess.CompletedProcess:
    stdin = "".join(json.dumps(p) + "\n" for p in pairs) + "not json\n"
    return subprocess.run([str(BIN / "sluice"), "cache-check", *args], input=stdin, capture_output=True,
                          text=True, cwd=ROOT, timeout=120, env={**inherited_env(), **env})


def run(pairs, *args, **env):
    result = check(pairs, *args, **env)
    assert result.returncode == 0, result.stderr
    return [json.loads(line) for line in result.stdout.splitlines()]


LEXICAL = json.dumps({"cache": {"max_false_hit_rate": 0}})     # τ and the checks decide


def test_decisions_with_the_reason_that_decided():
    exact, semantic, swapped, time_sensitive, unrelated, bad = run(PAIRS, "--route", LEXICAL)
    assert exact == {"hit": True, "tier": "exact", "similarity": 1.0, "reason": "exact", "score": None}
    assert semantic["hit"] and semantic["tier"] == "semantic" and semantic["similarity"] >= 0.94
    assert not swapped["hit"] and swapped["reason"] in ("order_differs", "below_threshold")
    assert time_sensitive == {"hit": False, "tier": None, "similarity": None, "reason": "a_not_stored:time_sensitive",
                              "score": None}
    assert not unrelated["hit"] and unrelated["reason"] == "below_threshold" and unrelated["similarity"] < 0.5
    assert "error" in bad
    assert semantic["score"] is None                 # the verifier is not asked with max_false_hit_rate 0


def test_the_default_route_asks_the_verifier():
    from sidecar.cache.verifier import load_verifier
    _, semantic, _, _, _, _ = run(PAIRS)
    assert 0.0 <= semantic["score"] <= 1.0
    assert semantic["hit"] == (semantic["score"] >= round(load_verifier().threshold(0.05), 4))


def test_the_verifier_scores_the_candidate_when_a_route_sets_a_false_hit_rate():
    route = json.dumps({"cache": {"max_false_hit_rate": 0.02}})
    exact, semantic, swapped, _, unrelated, _ = run(PAIRS, "--route", route)
    assert exact["score"] is None and unrelated["score"] is None    # decided before the verifier
    from sidecar.cache.verifier import load_verifier
    assert 0.0 <= semantic["score"] <= 1.0
    assert semantic["hit"] == (semantic["score"] >= round(load_verifier().threshold(0.02), 4))
    assert semantic["reason"] == ("ok" if semantic["hit"] else "verifier_rejected")
    assert not swapped["hit"]
    assert swapped["score"] is None or swapped["score"] < semantic["score"]


def test_route_settings_apply():
    off, = run(PAIRS[1:2], "--route", json.dumps({"cache": {"semantic": False}}))[:1]
    assert off == {"hit": False, "tier": None, "similarity": None, "reason": "no_semantic_tier", "score": None}
    bad = subprocess.run([str(BIN / "sluice"), "cache-check", "--route", '{"cache": {"ttl_s": "x"}}'],
                         input="", capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert bad.returncode == 2 and "ttl_s" in bad.stderr.lower() + bad.stderr


def test_the_sidecar_wide_switches_apply_as_in_the_server():
    assert run(PAIRS[:1], REDIS_URL="redis://127.0.0.1:1/0")[0]["tier"] == "exact"    # Redis is not asked
    cache_off = run(PAIRS[:1], SLUICE_CACHE="false")[0]
    assert cache_off == {"hit": False, "tier": None, "similarity": None, "reason": "cache_off", "score": None}
    exact, paraphrase = run(PAIRS[:2], SLUICE_SEMANTIC="false")[:2]
    assert exact["tier"] == "exact" and not paraphrase["hit"] and paraphrase["reason"] == "no_semantic_tier"


def test_a_route_that_names_its_tenant_by_header_is_checked_with_that_header():
    route = json.dumps({"cache": {"tenant_header": "x-sluice-tenant", "semantic": False}})
    assert run(PAIRS[:1], "--route", route)[0]["tier"] == "exact"          # not "anonymous"


def test_a_route_by_name_from_an_envoy_config(tmp_path):
    config = envoy_config.render()
    envoy_config.set_routes(config, [envoy_config.chat_route("strict", "/", [{"cluster": "upstream_a"}])])
    envoy_config.http_connection_manager(config)["route_config"]["virtual_hosts"][0]["routes"][0][
        "metadata"]["filter_metadata"]["sluice"]["cache"] = {"semantic": False}
    path = envoy_config.write(config, tmp_path / "envoy.yaml")
    assert run(PAIRS[1:2], "--route", "strict", "--envoy-config", str(path))[0]["reason"] == "no_semantic_tier"
    missing = check([], "--route", "nope", "--envoy-config", str(path))
    assert missing.returncode == 2 and "no route named 'nope'" in missing.stderr and "strict" in missing.stderr
    for bad in ("5", "[1]"):
        refused = check([], "--route", bad, "--envoy-config", str(path))
        assert refused.returncode == 2 and "Traceback" not in refused.stderr, bad
    for text in ("{not: [yaml", "- a list\n", "static_resources: 5\n"):
        (tmp_path / "bad.yaml").write_text(text)
        refused = check([], "--route", "strict", "--envoy-config", str(tmp_path / "bad.yaml"))
        assert refused.returncode == 2 and "Traceback" not in refused.stderr, text


def test_progress_on_stderr_only_when_asked_or_on_a_terminal(tmp_path):
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"a": f"question {i}", "b": f"question {i}"}) + "\n" for i in range(3)))
    env = {**inherited_env(), "SLUICE_SEMANTIC": "false"}
    with pairs.open() as stdin:
        shown = subprocess.run([str(BIN / "sluice"), "cache-check", "--progress"], stdin=stdin, capture_output=True,
                               text=True, cwd=ROOT, timeout=120, env=env)
    assert shown.returncode == 0, shown.stderr
    assert "cache-check: pairs: 3, 100%" in shown.stderr
    assert len(shown.stdout.splitlines()) == 3                   # stdout keeps only the verdicts
    with pairs.open() as stdin:
        piped = subprocess.run([str(BIN / "sluice"), "cache-check"], stdin=stdin, capture_output=True,
                               text=True, cwd=ROOT, timeout=120, env=env)
    assert "pairs" not in piped.stderr                          # stderr is no terminal here
