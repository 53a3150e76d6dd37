"""Shared pytest hooks."""

FUZZ_CASES: dict[str, int] = {}


def pytest_terminal_summary(terminalreporter):
    if FUZZ_CASES:
        terminalreporter.section("schemathesis fuzz: cases run per endpoint")
        for operation, count in sorted(FUZZ_CASES.items()):
            terminalreporter.write_line(f"{count:6d}  {operation}")
        terminalreporter.write_line(f"{sum(FUZZ_CASES.values()):6d}  in all")
