"""Which event loop `sluice serve` runs on (sidecar/service/event_loop.py)."""
import asyncio
import sys

import pytest

from sidecar.config import ConfigError, SidecarConfig
from sidecar.service.event_loop import loop_factory


def test_auto_and_uvloop_pick_uvloop_when_installed():
    uvloop = pytest.importorskip("uvloop")
    for choice in ("auto", "uvloop"):
        factory, name = loop_factory(choice)
        assert name == "uvloop"
        with asyncio.Runner(loop_factory=factory) as runner:
            assert isinstance(runner.get_loop(), uvloop.Loop)
            assert runner.run(asyncio.sleep(0, result="ran")) == "ran"


def test_asyncio_is_the_standard_librarys_loop():
    factory, name = loop_factory("asyncio")
    assert (factory, name) == (None, "asyncio")
    with asyncio.Runner(loop_factory=factory) as runner:
        assert type(runner.get_loop()).__module__.startswith("asyncio.")


def test_without_uvloop_auto_falls_back_and_uvloop_refuses_to_start(monkeypatch):
    monkeypatch.setitem(sys.modules, "uvloop", None)      # import uvloop now raises ImportError
    assert loop_factory("auto") == (None, "asyncio")
    with pytest.raises(ConfigError, match="uvloop is not installed"):
        loop_factory("uvloop")


def test_unknown_choice_is_a_config_error():
    assert SidecarConfig.from_env({"SLUICE_EVENT_LOOP": "asyncio"}).event_loop == "asyncio"
    with pytest.raises(ConfigError, match="event_loop"):
        SidecarConfig.from_env({"SLUICE_EVENT_LOOP": "trio"})
    with pytest.raises(ValueError, match="trio"):
        loop_factory("trio")
