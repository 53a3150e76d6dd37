"""Hugging Face Hub ids (``--model org/name``, ``"model": "org/name"``): the repository's
config.json through huggingface_hub, the local cache first.

I/O, so outside the pure core: the adapters turn a Hub id that is not a catalogue name or alias
into the request's ``model_config`` before the core sees it. huggingface_hub's own rules apply:
the cache is ``HF_HUB_CACHE`` (or ``HF_HOME``/hub), ``HF_HUB_OFFLINE=1`` forbids the network, and
a gated repository is read with the user's token (``HF_TOKEN``, or the one ``hf auth login``
stored), which ``hf_hub_download`` picks up itself.
"""

from __future__ import annotations

import json
import os
from typing import Any, TypeVar

from planner.model.catalogue import HUB_ID, MAX_MODEL_FILE_BYTES, find_entry
from planner.errors import PlannerError, UnknownModelError

EXTRA = "pip install -e '.[backend]'"
Request = TypeVar("Request")


def _offline(constants) -> bool:
    # huggingface_hub reads HF_HUB_OFFLINE when it is imported; a server started before the
    # variable changed reads it again here
    flag = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return bool(constants.HF_HUB_OFFLINE) or flag.strip().upper() in {"1", "ON", "YES", "TRUE"}


def hub_config(repo_id: str) -> tuple[dict[str, Any], str]:
    """(the config.json of ``repo_id`` as a dict, where it was read from)."""
    try:
        from huggingface_hub import constants, hf_hub_download, try_to_load_from_cache
        from huggingface_hub import errors
    except ImportError:
        raise PlannerError(f"model {repo_id!r} is a Hugging Face Hub id; reading its config.json needs "
                           f"huggingface_hub, in the backend extra: {EXTRA}") from None
    cache_dir = os.environ.get("HF_HUB_CACHE") or None
    cached = try_to_load_from_cache(repo_id, "config.json", cache_dir=cache_dir)
    path = cached if isinstance(cached, str) else None
    if path is None and _offline(constants):
        raise PlannerError(f"model {repo_id!r}: offline (HF_HUB_OFFLINE=1) and its config.json is not in the "
                           f"Hugging Face cache ({cache_dir or constants.HF_HUB_CACHE})")
    if path is None:
        _reachable(repo_id, constants, cache_dir)
        try:
            path = hf_hub_download(repo_id, "config.json", cache_dir=cache_dir)
        except errors.GatedRepoError:
            raise PlannerError(f"model {repo_id!r} is gated on the Hugging Face Hub: accept its license there and "
                               "give a token (HF_TOKEN, or `hf auth login`)") from None
        except errors.RepositoryNotFoundError:
            raise UnknownModelError(f"unknown model {repo_id!r}: no such Hugging Face Hub repository "
                                    "(or it is private and no token with access was given)") from None
        except errors.LocalEntryNotFoundError:  # a subclass of EntryNotFoundError: first
            raise PlannerError(f"model {repo_id!r}: the Hub cannot be reached and its config.json is not in "
                               f"the Hugging Face cache ({cache_dir or constants.HF_HUB_CACHE})") from None
        except errors.EntryNotFoundError:
            raise PlannerError(f"model {repo_id!r}: the repository has no config.json") from None
        except (errors.HfHubHTTPError, OSError) as exc:
            raise PlannerError(f"model {repo_id!r}: config.json could not be read from the Hub: "
                               f"{str(exc).splitlines()[0][:200]}") from None
    return _read(path, repo_id), path


# huggingface_hub retries a failed connection with backoff (utils/_http.py http_backoff: 5 retries,
# about 25 s without a network); one request of this long says first whether the Hub answers at all.
REACH_TIMEOUT_SECONDS = 3.0


def _reachable(repo_id: str, constants, cache_dir: str | None) -> None:
    """Refuse at once, in one line, when the Hub's endpoint does not answer (no network)."""
    from huggingface_hub.utils import get_session  # lazily, as hub_config imports huggingface_hub (backend extra)

    try:
        get_session().head(constants.ENDPOINT, timeout=REACH_TIMEOUT_SECONDS, follow_redirects=False)
    except Exception as exc:  # noqa: BLE001 - any transport failure means the same: no Hub from here
        raise PlannerError(f"model {repo_id!r}: the Hugging Face Hub ({constants.ENDPOINT}) cannot be reached "
                           f"({type(exc).__name__}) and its config.json is not in the cache "
                           f"({cache_dir or constants.HF_HUB_CACHE}): give the config with --model-file config.json "
                           "(model_config in the API), or set HF_HUB_OFFLINE=1 to read the cache only") from None


def _read(path: str, repo_id: str) -> dict[str, Any]:
    try:
        if os.path.getsize(path) > MAX_MODEL_FILE_BYTES:
            raise PlannerError(f"model {repo_id!r}: config.json is larger than {MAX_MODEL_FILE_BYTES} bytes")
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PlannerError(f"model {repo_id!r}: the cached config.json ({path}) cannot be read: {exc}") from None
    if not isinstance(data, dict):
        raise PlannerError(f"model {repo_id!r}: config.json is not a JSON object")
    return data


def needs_hub(request: Any) -> bool:
    """Whether the request names a Hub id that is not a catalogue name or alias (its config.json
    is read from the Hub or its cache: I/O)."""
    name = getattr(request, "model", None)
    return name is not None and find_entry(name) is None and HUB_ID.match(name) is not None


def with_hub_model(request: Request) -> Request:
    """The request with a Hub id that is not a catalogue name or alias replaced by the
    repository's config.json (as ``model_config``, named after the id); any other request as is."""
    if not needs_hub(request):
        return request
    name = request.model
    config, _ = hub_config(name)
    source = f"https://huggingface.co/{name}/blob/main/config.json"
    return request.model_copy(update={"model": None,
                                      "model_config_": {"name": name, "source": source, "config": config}})
