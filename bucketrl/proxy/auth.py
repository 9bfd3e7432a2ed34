"""Bearer-token authentication and roles.

Tokens come from ``BUCKETRL_TOKENS`` (comma-separated ``role:token`` pairs) and/or the file named by
``BUCKETRL_TOKENS_FILE`` (same pairs, one a line; ``#`` comments and blank lines ignored), e.g.::

    BUCKETRL_TOKENS="trainer:t-secret,generator:g-secret,viewer:v-secret,admin:a-secret"

Roles: ``admin`` ⊇ {``trainer``, ``generator``, ``viewer``}. A missing or unknown token is 401; a known
token whose role may not call the route is 403. Tokens are compared with ``hmac.compare_digest`` against
every configured token (no early exit), so timing reveals nothing about which prefix matched.

Without any token configured the proxy refuses to start unless ``BUCKETRL_ALLOW_ANONYMOUS=true`` AND it
binds a loopback address (the embedded ``bucketrl up`` mode); then every caller is ``admin`` and a loud
warning says so at start.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
from dataclasses import dataclass
from pathlib import Path

from bucketrl import errors

log = logging.getLogger("bucketrl.proxy.auth")

ROLES = ("admin", "trainer", "generator", "viewer")
ANONYMOUS = "anonymous"


@dataclass(frozen=True)
class Principal:
    """Who is calling: the role of the token that matched (``admin`` for anonymous embedded mode)."""

    role: str
    anonymous: bool = False

    def may(self, *roles: str) -> bool:
        return self.role == "admin" or self.role in roles


def parse_pairs(text: str, source: str) -> list[tuple[str, str]]:
    """Parse ``role:token`` pairs separated by commas or newlines; raise ValueError naming the bad entry."""
    pairs: list[tuple[str, str]] = []
    for raw in text.replace("\n", ",").split(","):
        item = raw.strip()
        if not item or item.startswith("#"):
            continue
        role, sep, token = item.partition(":")
        role, token = role.strip(), token.strip()
        if not sep or not token:
            raise ValueError(f"{source}: entry {item[:20]!r}... is not 'role:token'")
        if role not in ROLES:
            raise ValueError(f"{source}: unknown role {role!r} (expected one of {', '.join(ROLES)})")
        pairs.append((role, token))
    return pairs


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class TokenAuth:
    """Maps a bearer token to a :class:`Principal` in constant time."""

    def __init__(self, pairs: list[tuple[str, str]], *, anonymous: bool = False) -> None:
        self._pairs = [(role, token.encode()) for role, token in pairs]
        self.anonymous = anonymous

    @classmethod
    def from_settings(cls, tokens: str, tokens_file: str | None, allow_anonymous: bool, host: str) -> TokenAuth:
        pairs = parse_pairs(tokens, "BUCKETRL_TOKENS")
        if tokens_file:
            path = Path(tokens_file)
            try:
                text = path.read_text()
            except OSError as exc:
                raise ValueError(f"BUCKETRL_TOKENS_FILE={tokens_file!r} cannot be read: {exc}") from exc
            pairs += parse_pairs(text, f"BUCKETRL_TOKENS_FILE={tokens_file}")
        if pairs:
            return cls(pairs)
        if not allow_anonymous:
            raise ValueError(
                "no tokens configured: set BUCKETRL_TOKENS (role:token pairs) or BUCKETRL_TOKENS_FILE, "
                "or BUCKETRL_ALLOW_ANONYMOUS=true with a loopback --host for the embedded mode"
            )
        if not is_loopback(host):
            raise ValueError(
                f"BUCKETRL_ALLOW_ANONYMOUS=true is refused on host {host!r}: anonymous access is only allowed "
                "when the proxy binds a loopback address (127.0.0.1, ::1, localhost); configure BUCKETRL_TOKENS"
            )
        log.warning(
            "!!! AUTH DISABLED: no tokens configured and BUCKETRL_ALLOW_ANONYMOUS=true; every caller on %s is "
            "admin. This is the embedded single-machine mode only. !!!",
            host,
        )
        return cls([], anonymous=True)

    def authenticate(self, authorization: str | None) -> Principal:
        if self.anonymous:
            return Principal("admin", anonymous=True)
        if not authorization:
            raise errors.Unauthorized("missing 'Authorization: Bearer <token>' header")
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise errors.Unauthorized("the Authorization header must be 'Bearer <token>'")
        given = token.strip().encode()
        matched: str | None = None
        # Compare against every token so the time taken does not depend on which one matched.
        for role, expected in self._pairs:
            if hmac.compare_digest(given, expected) and matched is None:
                matched = role
        if matched is None:
            raise errors.Unauthorized("unknown bearer token")
        return Principal(matched)
