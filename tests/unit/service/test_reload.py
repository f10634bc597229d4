"""Sidecar-wide settings from a KEY=VALUE file, reloaded live on SIGHUP or a file change."""
import asyncio
import logging

import pytest

from sidecar.observability import metrics
from sidecar.config import ConfigError
from sidecar.service.reload import Reloader, load_config, read_config_file


def write(tmp_path, text: str) -> str:
    path = tmp_path / "sluice.env"
    path.write_text(text)
    return str(path)


def test_file_format(tmp_path):
    path = write(tmp_path, "# comment\n\nSLUICE_LOG_LEVEL=DEBUG\nexport SLUICE_GRACE_S = 3\n"
                           "SLUICE_REDIS_URL='redis://r:6379/0'\nSLUICE_CACHE_SECRET=\"a=b c\"\n")
    assert read_config_file(path) == {"SLUICE_LOG_LEVEL": "DEBUG", "SLUICE_GRACE_S": "3",
                                      "SLUICE_REDIS_URL": "redis://r:6379/0", "SLUICE_CACHE_SECRET": "a=b c"}


@pytest.mark.parametrize("text, message", [
    ("SLUICE_LOG_LEVEL DEBUG\n", ":1: expected KEY=VALUE"),
    ("# ok\nSLUICE_LOG_LEVL=DEBUG\n", ":2: SLUICE_LOG_LEVL is not a sidecar-wide setting"),
    ("SLUICE_CONFIG_FILE=/other\n", "SLUICE_CONFIG_FILE is not a sidecar-wide setting"),
    ("SLUICE_EMBED_PROVIDER=cpu\n", "read from the environment only"),
    ("=x\n", "expected KEY=VALUE"),
])
def test_bad_lines_name_the_line(tmp_path, text, message):
    with pytest.raises(ConfigError, match=message):
        read_config_file(write(tmp_path, text))


def test_missing_file_names_the_setting(tmp_path):
    with pytest.raises(ConfigError, match="config_file: cannot read"):
        load_config({"SLUICE_CONFIG_FILE": str(tmp_path / "nope.env")})


def test_file_wins_over_environment_and_flags_win_over_both(tmp_path):
    path = write(tmp_path, "SLUICE_LOG_LEVEL=DEBUG\nSLUICE_GRACE_S=3\n")
    config = load_config({"SLUICE_CONFIG_FILE": path, "SLUICE_LOG_LEVEL": "ERROR", "SLUICE_GRACE_S": "7",
                          "SLUICE_DRAIN_DELAY_S": "2"}, grace_s=5.0, listen=None)
    assert (config.log_level, config.grace_s, config.drain_delay_s, config.config_file) == ("DEBUG", 5.0, 2.0, path)
    assert load_config({}, config_file=path).log_level == "DEBUG"


def test_a_bad_value_in_the_file_names_the_field(tmp_path):
    with pytest.raises(ConfigError, match="SLUICE_ACCESS_LOG"):
        load_config({"SLUICE_CONFIG_FILE": write(tmp_path, "SLUICE_ACCESS_LOG=perhaps\n")})


class Applied(list):
    def __call__(self, config):
        self.append(config)


def reloader(tmp_path, text: str):
    path = write(tmp_path, text)
    applied = Applied()
    load = lambda: load_config({"SLUICE_CONFIG_FILE": path})  # noqa: E731
    return Reloader(load(), load, applied), applied, tmp_path / "sluice.env"


def test_reload_applies_live_settings(tmp_path, caplog):
    r, applied, path = reloader(tmp_path, "SLUICE_LOG_LEVEL=INFO\n")
    path.write_text("SLUICE_LOG_LEVEL=DEBUG\nSLUICE_ACCESS_LOG=false\nSLUICE_LOG_PROMPTS=true\n")
    before = metrics.CONFIG_RELOADS.labels("ok")._value.get()
    with caplog.at_level(logging.INFO, "sluice.config"):
        assert r.reload()
    assert (r.current.log_level, r.current.access_log, r.current.log_prompts) == ("DEBUG", False, True)
    assert applied == [r.current]
    assert metrics.CONFIG_RELOADS.labels("ok")._value.get() == before + 1
    assert "log_level='DEBUG'" in caplog.text


def test_settings_that_need_a_restart_keep_their_running_value(tmp_path, caplog):
    r, applied, path = reloader(tmp_path, "SLUICE_GRACE_S=3\n")
    path.write_text("SLUICE_GRACE_S=9\nSLUICE_LISTEN=0.0.0.0:7000\nSLUICE_ACCESS_LOG=false\n")
    with caplog.at_level(logging.INFO, "sluice.config"):
        assert r.reload()
    assert (r.current.grace_s, r.current.listen, r.current.access_log) == (3.0, "127.0.0.1:50051", False)
    assert "listen, grace_s changed but need a restart" in caplog.text


@pytest.mark.parametrize("text, named", [
    ("SLUICE_LOG_LEVEL=LOUD\n", "log_level"),
    ("SLUICE_ACCESS_LOG=false\nSLUICE_TYPO=1\n", "SLUICE_TYPO"),
])
def test_a_bad_file_keeps_the_running_settings(tmp_path, caplog, text, named):
    r, applied, path = reloader(tmp_path, "SLUICE_LOG_LEVEL=WARNING\n")
    running = r.current
    path.write_text(text)
    before = metrics.CONFIG_RELOADS.labels("error")._value.get()
    with caplog.at_level(logging.ERROR, "sluice.config"):
        assert not r.reload()
    assert r.current is running and applied == []
    assert metrics.CONFIG_RELOADS.labels("error")._value.get() == before + 1
    assert "keeping the running settings" in caplog.text and named in caplog.text


async def test_watch_reloads_when_the_file_changes(tmp_path):
    r, applied, path = reloader(tmp_path, "SLUICE_LOG_PROMPTS=false\n")
    task = asyncio.create_task(r.watch(str(path), 0.01))
    try:
        await asyncio.sleep(0.05)
        assert applied == []                      # unchanged: no reload
        path.write_text("SLUICE_LOG_PROMPTS=true\n")
        for _ in range(100):
            if applied:
                break
            await asyncio.sleep(0.01)
        assert applied and r.current.log_prompts
    finally:
        task.cancel()
