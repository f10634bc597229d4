import shutil

import pytest

from devtools.stack import Stack


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
def make_stack(tmp_path_factory):
    """Start stacks that are stopped when the module's tests are done."""
    stacks = []

    def make(**kwargs) -> Stack:
        stack = Stack(tmp_path_factory.mktemp("stack"), **kwargs).start()
        stacks.append(stack)
        return stack

    yield make
    for stack in stacks:
        stack.stop()
