"""Reading the shipped data files (data/gpus.yaml, links.yaml, models.yaml).

Importing PyYAML (its resolver compiles its regular expressions at import) and parsing gpus.yaml
and links.yaml took about a seventh of a whole `planner estimate` process here (~136 of ~1,036
million instructions under callgrind; bench/speed.py times the process). So each parsed file is
kept as Python's own ``marshal`` data beside it, the way CPython keeps a module's bytecode:
``data/__pycache__/NAME.yaml.cpython-311.marshal`` (under ``sys.pycache_prefix`` when one is set),
written by the first process that reads the file, unless writing bytecode is off
(``sys.dont_write_bytecode``: ``-B`` or ``PYTHONDONTWRITEBYTECODE``), and nowhere else. A cache is
used only while the SHA-256 of the YAML's bytes recorded in it equals that of the file read now,
so an edited file is parsed again; a missing, stale, truncated or unwritable cache only costs the
parse. ``write_caches()`` writes them on demand (as ``compileall`` does for the modules).

The parse itself uses libyaml's C loader (``yaml.CSafeLoader``, in PyYAML's binary wheels): the same
objects as the pure-Python SafeLoader, same constructor and resolver, about 8x faster
(tests/test_speed.py compares the two on every shipped file). Text a user supplies is still read by
``yaml.safe_load``, whose error messages the CLI and API show.
"""

from __future__ import annotations

import hashlib
import marshal
import os
import sys
from pathlib import Path
from typing import Any

DATA_DIR = Path(__file__).parent / "data"
# A cache file: this magic, the SHA-256 of the YAML it was made from, the SHA-256 of the payload,
# the payload (marshal.dumps of the parsed content).
_MAGIC = b"planner data cache 1\n"  # bump when that layout changes
_DIGEST_BYTES = 32  # SHA-256
_MISSING = object()


def cache_path(path: Path) -> Path | None:
    """Where the parsed form of a data file is kept: beside it in __pycache__, or under
    sys.pycache_prefix as CPython places a module's .pyc (importlib's cache_from_source);
    None where the interpreter has no cache tag (then nothing is cached)."""
    tag = sys.implementation.cache_tag
    if tag is None:
        return None
    name = f"{path.name}.{tag}.marshal"
    if sys.pycache_prefix is not None:
        folder = os.path.splitdrive(os.path.abspath(path.parent))[1].lstrip(os.sep)
        return Path(sys.pycache_prefix, folder, name)
    return path.parent / "__pycache__" / name


def load_data_yaml(path: Path) -> Any:
    """A shipped YAML file's content (it parses: tests load every one), from its cache when the
    cache was made from these very bytes."""
    source = path.read_bytes()
    digest = hashlib.sha256(source).digest()
    cache = cache_path(path)
    data = _read_cache(cache, digest) if cache is not None else _MISSING
    if data is _MISSING:
        data = _parse(source)
        if cache is not None and not sys.dont_write_bytecode:
            _write_cache(cache, digest, data)
    return data


def write_caches(folder: Path = DATA_DIR) -> list[Path]:
    """Parse every data file of ``folder`` and write its cache, whatever sys.dont_write_bytecode
    says (the caller asks for it, as with compileall); the caches written."""
    written = []
    for path in sorted(folder.glob("*.yaml")):
        source = path.read_bytes()
        cache = cache_path(path)
        if cache is not None and _write_cache(cache, hashlib.sha256(source).digest(), _parse(source)):
            written.append(cache)
    return written


def _parse(source: bytes) -> Any:
    import yaml  # only when a cache is missing or stale

    return yaml.load(source, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))  # no libyaml: same, slower


def _read_cache(cache: Path, digest: bytes) -> Any:
    try:
        blob = cache.read_bytes()
    except OSError:
        return _MISSING
    header = _MAGIC + digest
    if not blob.startswith(header):
        return _MISSING  # another file's, another version's, or not ours
    body = memoryview(blob)[len(header):]
    if hashlib.sha256(body[_DIGEST_BYTES:]).digest() != body[:_DIGEST_BYTES]:
        return _MISSING  # truncated or damaged
    try:
        return marshal.loads(body[_DIGEST_BYTES:])
    except (EOFError, ValueError, TypeError):
        return _MISSING


def _write_cache(cache: Path, digest: bytes, data: Any) -> bool:
    try:
        payload = marshal.dumps(data)
    except ValueError:  # a value marshal cannot keep (a YAML timestamp): the file is parsed each time
        return False
    import _thread

    # Written whole under a name of this process and thread, then renamed over the old one (as
    # importlib writes a .pyc): a reader sees the old cache or the new one, never half of one. The
    # mode is a .pyc's: 0o666 less the umask.
    temporary = f"{cache}.{os.getpid()}.{_thread.get_ident()}.tmp"
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    except OSError:  # a read-only install: parsed each time, as before
        return False
    try:
        with open(descriptor, "wb") as handle:
            handle.write(_MAGIC + digest + hashlib.sha256(payload).digest() + payload)
        os.replace(temporary, cache)
    except OSError:
        try:
            os.unlink(temporary)
        except OSError:
            pass
        return False
    return True
