import pytest
import torch

# Tests run tiny models: one thread is as fast, and it does not oversubscribe a busy 2-core machine.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def token_cache(tmp_path_factory) -> str:
    """A cache folder (for $CGAD_CACHE_DIR) holding the bundled corpus's tokenizer and token array,
    made once for the session, apart from the user's own cache: the real daemons, demos and
    benches the tests start read it, instead of every test's first node training the tokenizer and
    tokenizing the corpus again (seconds of CPU each time; making them is tested in test_data.py)."""
    from cgad.node.training.data import load_dataset
    from cgad.node.training.tokenizer import load_tokenizer

    cache = tmp_path_factory.mktemp("token-cache")
    load_dataset(load_tokenizer(None, cache_dir=cache), cache_dir=cache)
    return str(cache)


@pytest.fixture
def daemons(tmp_path, monkeypatch, token_cache):
    """A folder for real `cgad-node join` processes (tests/_daemons.py) and the list to put them
    in; every one of them is killed at the end, whatever the test did. They share the session's
    token cache."""
    monkeypatch.setenv("CGAD_CACHE_DIR", token_cache)
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


def pytest_collection_modifyitems(items):
    """The tiers (Makefile): the system tier runs with the daemons, one test at a time, so a test
    marked ``system`` must be marked ``integration`` too, or `make test` would run it side by side
    with others."""
    loose = [
        item.nodeid
        for item in items
        if item.get_closest_marker("system") and not item.get_closest_marker("integration")
    ]
    if loose:
        raise pytest.UsageError(f"marked system but not integration: {loose}")
