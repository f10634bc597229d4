import shutil

import pytest

from devtools.stack import Stack
from tests.support.redis_server import RedisServer


def pytest_collection_modifyitems(items):
    for item in items:
        if "e2e" in item.nodeid.split("::")[0]:
            item.add_marker(pytest.mark.e2e)


@pytest.fixture(scope="session", autouse=True)
def _require_binaries():
    missing = [b for b in ("openssl",) if shutil.which(b) is None]
    if missing:
        pytest.exit(f"missing system tools {missing}: run `make system-deps`", returncode=3)


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    """A real redis-server for a module's tests (skipped where none is installed)."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


def _stack_factory(tmp_path_factory):
    stacks = []

    def make(**kwargs) -> Stack:
        # Routing tests repeat prompts; a cache would answer them. Cache tests turn it on.
        kwargs.setdefault("sidecar_env", {"SLUICE_CACHE": "false"})
        stack = Stack(tmp_path_factory.mktemp("stack"), **kwargs).start()
        stacks.append(stack)
        return stack

    yield make
    for stack in stacks:
        stack.stop()


@pytest.fixture(scope="module")
def make_module_stack(tmp_path_factory):
    """Start stacks shared by a module's tests, stopped when they are done."""
    yield from _stack_factory(tmp_path_factory)


@pytest.fixture
def make_stack(tmp_path_factory):
    """Start stacks for one test, stopped when it ends."""
    yield from _stack_factory(tmp_path_factory)
