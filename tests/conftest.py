"""Shared pytest hooks and fixtures."""

import pytest

FUZZ_CASES: dict[str, int] = {}


def pytest_terminal_summary(terminalreporter):
    if FUZZ_CASES:
        terminalreporter.section("schemathesis fuzz: cases run per endpoint")
        for operation, count in sorted(FUZZ_CASES.items()):
            terminalreporter.write_line(f"{count:6d}  {operation}")
        terminalreporter.write_line(f"{sum(FUZZ_CASES.values()):6d}  in all")


@pytest.fixture()
def recorded_hops(tmp_path, monkeypatch):
    """A test client of the app whose threadpool hops are recorded by function name: which
    requests leave the event loop (I/O, tracing, parsing) and which are answered on it."""
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    import web.app

    hops: list[str] = []

    async def recorded(function, *args):
        hops.append(function.__name__)
        return function(*args)

    monkeypatch.setattr(web.app, "run_in_threadpool", recorded)
    return TestClient(web.app.create_app(str(tmp_path / "runs.sqlite"))), hops
