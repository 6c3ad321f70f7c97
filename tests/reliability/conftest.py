"""The reliability scenarios (bench/reliability, importable through pytest's `pythonpath`): their
full-size variants run only when asked for."""


def pytest_collection_modifyitems(config, items):
    """The full-size variants (marked slow) run only when asked for: `pytest -m slow tests/reliability`
    (`make test` stays within its time; bench/chaos.py runs them too)."""
    import pytest

    if "slow" in (config.getoption("markexpr") or ""):
        return
    skip = pytest.mark.skip(reason="full-size reliability run: pytest -m slow tests/reliability, or bench/chaos.py")
    for item in items:
        if item.get_closest_marker("slow") is not None and "reliability" in str(item.fspath):
            item.add_marker(skip)
