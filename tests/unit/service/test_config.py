import pytest

from devtools.stack import inherited_env
from sidecar.config import ConfigError, SidecarConfig, redacted_url


def test_env_then_overrides():
    config = SidecarConfig.from_env({"SLUICE_LISTEN": "0.0.0.0:6000", "SLUICE_GRACE_S": "3",
                                     "SLUICE_LOG_PROMPTS": "true"}, grace_s=5.0, listen=None)
    assert (config.listen, config.grace_s, config.log_prompts) == ("0.0.0.0:6000", 5.0, True)


@pytest.mark.parametrize("environ, field", [
    ({"SLUICE_LISTEN": "6000"}, "listen"),
    ({"SLUICE_GRACE_S": "soon"}, "SLUICE_GRACE_S"),
    ({"SLUICE_DRAIN_DELAY_S": "-1"}, "drain_delay_s"),
    ({"SLUICE_LOG_PROMPTS": "maybe"}, "SLUICE_LOG_PROMPTS"),
    ({"SLUICE_LOG_LEVEL": "LOUD"}, "log_level"),
    ({"SLUICE_TRACE_SAMPLE_RATIO": "1.5"}, "trace_sample_ratio"),
    ({"SLUICE_OTLP_ENDPOINT": "collector:4317"}, "otlp_endpoint"),
    ({"SLUICE_CONFIG_WATCH_S": "-1"}, "config_watch_s"),
    ({"SLUICE_ACCESS_LOG": "perhaps"}, "SLUICE_ACCESS_LOG"),
    ({"SLUICE_DRAIN_DELAY_S": "nan"}, "drain_delay_s"),            # a sleep that never ends
    ({"SLUICE_GRACE_S": "inf"}, "grace_s"),
    ({"SLUICE_CONFIG_WATCH_S": "NaN"}, "config_watch_s"),
    ({"SLUICE_LISTEN": "127.0.0.1:5005\u00b2"}, "listen"),        # a digit to isdigit(), not to int()
    ({"SLUICE_REDIS_URL": "redis://localhost:abc/0", "SLUICE_CACHE_SECRET": "s" * 16}, "redis_url"),
    ({"SLUICE_REDIS_URL": "rediss://h:99999", "SLUICE_CACHE_SECRET": "s" * 16}, "redis_url"),
    ({"SLUICE_REDIS_URL": "redis://r:6379/0"}, "cache_secret"),    # replicas would not agree on tenants
    ({"SLUICE_METRICS_LISTEN": "127.0.0.1:\u0669"}, "metrics_listen"),   # Arabic-Indic nine
    ({"SLUICE_REDIS_TIMEOUT_S": "0"}, "redis_timeout_s"),
    ({"SLUICE_REDIS_TIMEOUT_S": "nan"}, "redis_timeout_s"),
    ({"SLUICE_CACHE_MAX_MIB": "0.5"}, "cache_max_mib"),
    ({"SLUICE_CACHE_MAX_MIB": "inf"}, "cache_max_mib"),
    ({"SLUICE_CACHE_MAX_MIB": "lots"}, "SLUICE_CACHE_MAX_MIB"),
])
def test_bad_values_name_the_field(environ, field):
    with pytest.raises(ConfigError, match=field):
        SidecarConfig.from_env(environ)


def test_the_cache_byte_budget_reaches_the_store():
    from sidecar.service.app import _limits
    from sidecar.cache.budget import CacheBudget
    budget = CacheBudget(64 * 2**20)
    assert _limits(SidecarConfig.from_env({"SLUICE_CACHE_MAX_MIB": "64"})).max_bytes == budget.store
    assert budget.store + budget.profiles + budget.memos + budget.false_hits + budget.token_states <= 64 * 2**20
    assert budget.store > 0.75 * 64 * 2**20


def test_the_metrics_address_of_an_ipv6_listen_has_no_brackets():
    assert SidecarConfig(metrics_listen="[::1]:9464").metrics_address == ("::1", 9464)
    assert SidecarConfig(metrics_listen="0.0.0.0:9464").metrics_address == ("0.0.0.0", 9464)


def test_a_stack_never_takes_redis_or_a_config_file_from_the_shell(monkeypatch):
    """A developer's REDIS_URL must not point `make run` or the tests at a real Redis."""
    for name in ("REDIS_URL", "SLUICE_REDIS_URL", "SLUICE_CACHE_SECRET", "SLUICE_CONFIG_FILE"):
        monkeypatch.setenv(name, "from-the-shell")
    monkeypatch.setenv("SLUICE_LOG_LEVEL", "DEBUG")
    env = inherited_env()
    assert not {"REDIS_URL", "SLUICE_REDIS_URL", "SLUICE_CACHE_SECRET", "SLUICE_CONFIG_FILE"} & set(env)
    assert env["SLUICE_LOG_LEVEL"] == "DEBUG"                  # other settings still pass


def test_a_redis_url_is_never_shown_with_its_password_and_a_malformed_one_is_a_config_error():
    assert redacted_url("rediss://user:s3cret@redis.internal:6380/0") == "rediss://redis.internal:6380/0"
    assert redacted_url("redis://r:6379/0") == "redis://r:6379/0"
    with pytest.raises(ConfigError, match="redis_url") as error:
        SidecarConfig.from_env({"SLUICE_REDIS_URL": "redis://:pw@[::1", "SLUICE_CACHE_SECRET": "s" * 16})
    assert "pw" not in str(error.value)


@pytest.mark.parametrize("environ, named", [
    ({"SLUICE_EMBED_MAX_QUEUE": "abc"}, "SLUICE_EMBED_MAX_QUEUE"),
    ({"SLUICE_EMBED_MAX_QUEUE": "0"}, "SLUICE_EMBED_MAX_QUEUE"),
    ({"SLUICE_EMBED_MODEL_PATH": "/models/mine.onnx"}, "SLUICE_EMBED_MODEL_SHA256"),   # without its SHA
    ({"SLUICE_GRACE_S": "-1"}, "SLUICE_GRACE_S"),
    ({"SLUICE_ON_INTERNAL_ERROR": "shrug"}, "SLUICE_ON_INTERNAL_ERROR"),
])
def test_sluice_serve_with_a_bad_value_exits_2_with_one_line_naming_the_variable(environ, named):
    """As the README promises: no traceback, nothing started."""
    import pathlib
    import subprocess
    import sys
    env = {**inherited_env(), **environ, "SLUICE_LISTEN": "127.0.0.1:1", "SLUICE_METRICS_LISTEN": ""}
    run = subprocess.run([sys.executable, "-m", "sidecar", "serve"], env=env, capture_output=True,
                         text=True, timeout=60, cwd=pathlib.Path(__file__).resolve().parents[3])
    assert run.returncode == 2, run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and named in lines[0] and lines[0].startswith("sluice: bad configuration"), run.stderr
