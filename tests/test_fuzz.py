"""Fuzz every REST endpoint from its own OpenAPI schema (schemathesis): no input may produce a
5xx, and every 2xx body must match the documented response schema. The number of cases each
endpoint ran is printed at the end of the pytest session (tests/conftest.py)."""

import pytest

pytest.importorskip("fastapi")
schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, settings  # noqa: E402
from schemathesis.checks import not_a_server_error, response_schema_conformance  # noqa: E402

from tests.conftest import FUZZ_CASES  # noqa: E402
from web.app import create_app  # noqa: E402

MAX_EXAMPLES = 40  # per endpoint and generation phase; ~1,000 cases in all, about a minute


def _app():
    import os
    import tempfile

    os.environ.pop("PLANNER_API_TOKEN", None)  # launching runs stays closed: verify answers 401
    os.environ.pop("PLANNER_API_TOKEN_FILE", None)
    return create_app(os.path.join(tempfile.mkdtemp(prefix="planner-fuzz-"), "runs.sqlite"))


schema = schemathesis.openapi.from_asgi("/openapi.json", _app())


@schema.parametrize()
@settings(max_examples=MAX_EXAMPLES, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much,
                                 HealthCheck.function_scoped_fixture])
def test_no_input_gives_a_server_error(case):
    FUZZ_CASES[f"{case.method} {case.path}"] = FUZZ_CASES.get(f"{case.method} {case.path}", 0) + 1
    case.call_and_validate(checks=[not_a_server_error, response_schema_conformance])
