"""Bearer tokens: who is calling (the tenant), from a token file that can change while we run.

The file (`cloud-verifier serve --auth-tokens FILE`) has one entry per line:

    # tenant   token, or sha256:<hex digest of the token>
    acme       sha256:4c1f0e...        # hashed at rest: `cloud-verifier hash-token` prints this
    dev        s3cr3t-plain-token      # plain: fine for a laptop, not for a shared secret store

Tokens are long random strings (`cloud-verifier new-token`), so an unsalted SHA-256 is enough
to keep the file from being a list of working secrets (a slow password hash buys nothing
against 256 random bits). Every presented token is hashed once and compared with every entry
by `hmac.compare_digest`, without stopping at the first match, so the time taken says nothing
about which entry, or which prefix, matched.

The file is read again when its modification time, size or inode changes (checked at most
once a second, on the next call) and on `reload()` (the server calls it on SIGHUP). A file
that no longer parses keeps the previous table and logs why: a typo must not lock everyone out.
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
import secrets
import threading
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

HASH_PREFIX = "sha256:"
MIN_TOKEN_CHARS = 16                 # shorter plain tokens are refused when the file is read
_TENANT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


def hash_token(token: str) -> str:
    """The at-rest form of a token: `sha256:<hex>`."""
    return HASH_PREFIX + hashlib.sha256(token.encode()).hexdigest()


def new_token() -> str:
    """A fresh random token (256 bits, URL-safe)."""
    return secrets.token_urlsafe(32)


class TokenFileError(ValueError):
    pass


@dataclass(frozen=True)
class _Entry:
    tenant: str
    digest: bytes        # sha256 of the token


def parse_token_file(text: str, source: str = "token file") -> list[_Entry]:
    entries: list[_Entry] = []
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 2:
            raise TokenFileError(f"{source}:{n}: expected `TENANT TOKEN` or `TENANT sha256:HEX`, got {len(parts)} fields")
        tenant, secret = parts
        if not _TENANT.match(tenant):
            raise TokenFileError(f"{source}:{n}: tenant {tenant!r} must be 1-64 of A-Z a-z 0-9 . _ -")
        if secret.startswith(HASH_PREFIX):
            hexdigest = secret[len(HASH_PREFIX):].lower()
            if not _HEX64.match(hexdigest):
                raise TokenFileError(f"{source}:{n}: {HASH_PREFIX} must be followed by 64 hex digits")
            digest = bytes.fromhex(hexdigest)
        else:
            if len(secret) < MIN_TOKEN_CHARS:
                raise TokenFileError(f"{source}:{n}: token of tenant {tenant!r} is shorter than {MIN_TOKEN_CHARS} "
                                     "characters; make one with `cloud-verifier new-token`")
            digest = hashlib.sha256(secret.encode()).digest()
        entries.append(_Entry(tenant, digest))
    if not entries:
        raise TokenFileError(f"{source}: no tokens (an empty file would lock every caller out)")
    return entries


def bearer_token(metadata) -> str | None:
    """The token of an `authorization: Bearer <token>` entry in call metadata, if any."""
    for key, value in metadata or ():
        if key.lower() == "authorization":
            if isinstance(value, bytes):
                value = value.decode("latin-1")
            scheme, _, token = value.strip().partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
    return None


class TokenFile:
    """Token -> tenant, from a file that is re-read when it changes."""

    def __init__(self, path: str | os.PathLike, check_interval_s: float = 1.0):
        self.path = Path(path)
        self.check_interval_s = check_interval_s
        self._lock = threading.Lock()
        self._entries: list[_Entry] = []
        self._stamp: tuple | None = None
        self._checked_at = 0.0
        self.reloads = 0
        self.reload(strict=True)

    def _file_stamp(self) -> tuple:
        st = self.path.stat()
        return st.st_mtime_ns, st.st_size, st.st_ino

    def reload(self, strict: bool = False) -> bool:
        """Read the file now. With strict=False a bad file keeps the old table (and logs why)."""
        try:
            stamp = self._file_stamp()
            entries = parse_token_file(self.path.read_text(), str(self.path))
        except (OSError, TokenFileError, UnicodeDecodeError) as e:
            if strict:
                raise TokenFileError(str(e)) from None
            log.error("auth tokens not reloaded, keeping the previous %d: %s", len(self._entries), e)
            return False
        with self._lock:
            self._entries, self._stamp = entries, stamp
            self.reloads += 1
        log.info("auth tokens loaded from %s: %d tokens, %d tenants", self.path, len(entries),
                 len({e.tenant for e in entries}))
        return True

    def _maybe_reload(self) -> None:
        now = time.monotonic()
        if now - self._checked_at < self.check_interval_s:
            return
        self._checked_at = now
        try:
            changed = self._file_stamp() != self._stamp
        except OSError:
            changed = True   # gone: reload() logs it and keeps the table
        if changed:
            self.reload()

    @property
    def tenants(self) -> set[str]:
        return {e.tenant for e in self._entries}

    def tenant_for(self, token: str | None) -> str | None:
        """The tenant a token belongs to, or None. Constant time in the token's content."""
        if token is None:
            return None
        self._maybe_reload()
        presented = hashlib.sha256(token.encode("utf-8", "surrogateescape")).digest()
        found = None
        for entry in self._entries:
            # No early exit: every entry is compared, whatever matched.
            if hmac.compare_digest(presented, entry.digest):
                found = entry.tenant
        return found
