"""The server's bearer token: where it is configured, how a request's header is compared with it.

web/app.py guards the run routes with it and web/pages.py keys the run pages' cookie by it; both
import it from here (the page layer does not reach into the app's private names).
"""

from __future__ import annotations

import hmac
import os

from fastapi import FastAPI, HTTPException

from planner.errors import PlannerError
from planner.model.catalogue import read_text_or_refuse

TOKEN_ENV, TOKEN_FILE_ENV = "PLANNER_API_TOKEN", "PLANNER_API_TOKEN_FILE"

MAX_TOKEN_FILE_BYTES = 4096  # a bearer token is tens of bytes


class TokenFileError(ValueError):
    """PLANNER_API_TOKEN_FILE is set but gives no token: the server's configuration is broken."""


def configured_token() -> str | None:
    """The server's token: PLANNER_API_TOKEN, else the text of PLANNER_API_TOKEN_FILE (read at each
    use, so a rotated file takes effect). None when neither is set. A token file that is set but
    cannot be read, is not text or is empty raises TokenFileError: were it taken as "no token", a
    permissions slip would make private run records public."""
    token = os.environ.get(TOKEN_ENV)
    path = os.environ.get(TOKEN_FILE_ENV)
    if token or not path:
        return token or None
    try:  # read at every request: never unbounded
        text = read_text_or_refuse(path, MAX_TOKEN_FILE_BYTES, f"{TOKEN_FILE_ENV}={path}",
                                   f"more than {MAX_TOKEN_FILE_BYTES} bytes; not a token")
    except PlannerError as exc:
        raise TokenFileError(str(exc)) from None
    if not text.strip():
        raise TokenFileError(f"{TOKEN_FILE_ENV}={path}: the file is empty")
    return text.strip()


def request_token() -> str | None:
    """configured_token() inside a request: a broken token file refuses the request (503, the
    server's fault), never lets it through."""
    try:
        return configured_token()
    except TokenFileError as exc:
        raise HTTPException(503, f"the server's token is misconfigured: {exc}") from None


def bearer(authorization: str | None) -> str | None:
    """The credentials of an 'Authorization: Bearer <token>' header; the scheme is case-insensitive
    (RFC 9110, section 11.1)."""
    scheme, _, credentials = (authorization or "").strip().partition(" ")
    return credentials.strip() if scheme.lower() == "bearer" and credentials.strip() else None


def token_matches(given: str | None, expected: str) -> bool:
    """Constant-time comparison of bytes: hmac.compare_digest refuses str with non-ASCII characters
    (a TypeError, so a 500), and a header may carry any latin-1 byte."""
    if given is None:
        return False
    return hmac.compare_digest(given.encode("utf-8", "surrogatepass"), expected.encode("utf-8", "surrogatepass"))


UNAUTHORIZED = (401, "a valid 'Authorization: Bearer <token>' header is required", {"WWW-Authenticate": "Bearer"})


def runs_are_private(app: FastAPI) -> bool:
    return request_token() is not None and not app.state.public_runs
