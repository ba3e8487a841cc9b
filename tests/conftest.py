import pytest
import torch

# Tests run tiny models: one thread is as fast, and it does not oversubscribe a busy 2-core machine.
torch.set_num_threads(1)


@pytest.fixture
def daemons(tmp_path, monkeypatch):
    """A folder for real `cgad-node join` processes (tests/_daemons.py) and the list to put them
    in; every one of them is killed at the end, whatever the test did."""
    monkeypatch.setenv("CGAD_CACHE_DIR", str(tmp_path / "cache"))
    started: list = []
    yield tmp_path, started
    for node in started:
        node.kill()


@pytest.fixture(scope="module")
def netswarm():
    """The four real transports of tests/_netswarm.py, shared by one test module's tests."""
    from _netswarm import running_swarm  # tests/ is on sys.path under pytest

    with running_swarm() as peers:
        yield peers
