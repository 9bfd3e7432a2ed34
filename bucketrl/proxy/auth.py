"""Bearer-token authentication and roles.

Tokens come from ``BUCKETRL_TOKENS`` (comma-separated ``role:token`` pairs) and/or the file named by
``BUCKETRL_TOKENS_FILE`` (same pairs, one a line; ``#`` comments and blank lines ignored), e.g.::

    BUCKETRL_TOKENS="trainer:t-secret,generator:g-secret,viewer:v-secret,admin:a-secret"

Roles: ``admin`` ⊇ {``trainer``, ``generator``, ``viewer``}. ``relay`` is a regional relay's own credential: it
reads the adapter uploads still being staged (``/v1/staging``) and nothing else; it is not a viewer. A generator
token reads its runs' staged uploads too (it reads their committed adapters anyway). A missing or unknown token is
401; a known token whose role may not call the route is 403.

Run scope: ``role@pattern|pattern:token`` limits a trainer, generator or viewer token to the runs matching one
of the glob patterns (``fnmatch``: ``*``, ``?``, ``[abc]``, ``[!abc]``), e.g. ``trainer@sweep-*|ablation:...``.
Without ``@`` a token reaches every run (the behaviour before scopes, so existing configurations are
unchanged). An admin token always sees every run: a scope on one is refused at start, as are an empty scope
and a pattern that can never match a run id. ``deps.run_scope`` enforces the scope on every route.

Tokens are compared with ``hmac.compare_digest`` against every configured token (no early exit), so
timing reveals nothing about which prefix matched.

Without any token configured the proxy refuses to start unless ``BUCKETRL_ALLOW_ANONYMOUS=true`` AND it
binds a loopback address (the embedded ``bucketrl up`` mode); then every caller is ``admin`` and a loud
warning says so at start.

Weak tokens are refused at start too: a known placeholder (``change-me...`` from ``.env.example``, ``changeme``,
``secret``, ...) or anything shorter than :data:`MIN_TOKEN_CHARS` characters, with a message naming the role and
how to generate one. ``BUCKETRL_INSECURE_DEV_TOKENS=true`` lifts that for a proxy bound to loopback only (a
developer's laptop, tests); it is refused on any other address.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import re
from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import Path

from bucketrl import errors

log = logging.getLogger("bucketrl.proxy.auth")

ROLES = ("admin", "trainer", "generator", "viewer", "relay")
ANONYMOUS = "anonymous"
# 16 characters of secrets.token_urlsafe carry 96 bits; shorter tokens are guessable or typed by hand.
MIN_TOKEN_CHARS = 16
_PLACEHOLDERS = ("change-me", "changeme", "change_me", "replace-me", "replaceme", "your-token", "placeholder")
_WEAK = {"secret", "password", "token", "admin", "trainer", "generator", "viewer", "test", "example"}
GENERATE = 'python3 -c "import secrets; print(secrets.token_urlsafe(24))"'


def weakness(token: str) -> str | None:
    """Why ``token`` must not guard a proxy (None if it may)."""
    low = token.lower()
    if any(low.startswith(p) for p in _PLACEHOLDERS) or low in _WEAK:
        return "is a placeholder"
    if len(token) < MIN_TOKEN_CHARS:
        return f"is shorter than {MIN_TOKEN_CHARS} characters"
    return None


def check_strength(entries: list[TokenEntry], host: str, insecure_dev_tokens: bool) -> None:
    """ValueError naming the first weak token's role, unless the insecure-dev switch is on AND ``host`` is
    loopback (then a warning)."""
    weak = [(e.role, why) for e in entries if (why := weakness(e.token)) is not None]
    if not weak:
        return
    role, why = weak[0]
    if insecure_dev_tokens and is_loopback(host):
        log.warning("BUCKETRL_INSECURE_DEV_TOKENS=true: accepting weak tokens (the %s token %s) on %s", role, why, host)
        return
    if insecure_dev_tokens:
        raise ValueError(
            f"BUCKETRL_INSECURE_DEV_TOKENS=true is refused on host {host!r}: weak tokens are only allowed when the "
            "proxy binds a loopback address; set real tokens"
        )
    raise ValueError(
        f"the {role} token {why}: every token must be a random secret of at least {MIN_TOKEN_CHARS} characters "
        f"(generate one with {GENERATE}); for a loopback-only development proxy, BUCKETRL_INSECURE_DEV_TOKENS=true"
    )


@dataclass(frozen=True)
class Principal:
    """Who is calling: the role of the token that matched (``admin`` for anonymous embedded mode) and the
    run patterns it is limited to (``None``: every run)."""

    role: str
    anonymous: bool = False
    runs: tuple[str, ...] | None = None

    def may(self, *roles: str) -> bool:
        return self.role == "admin" or self.role in roles

    def may_run(self, run: str) -> bool:
        return self.runs is None or any(fnmatchcase(run, pattern) for pattern in self.runs)


@dataclass(frozen=True)
class TokenEntry:
    role: str
    token: str
    runs: tuple[str, ...] | None = None  # None: every run


# What a run id may hold (wire.common.ID_PATTERN) plus the glob wildcards; bracket sets are checked apart.
_GLOB_CHARS = re.compile(r"^[A-Za-z0-9_.*?-]+$")
_BRACKET_SET = re.compile(r"\[!?[A-Za-z0-9_.-]+\]")


def parse_scope(text: str, role: str, where: str) -> tuple[str, ...]:
    """The glob patterns of ``role@pattern|pattern``; ValueError for a scope that could never be meant."""
    if role == "admin":
        raise ValueError(
            f"{where}: an admin token sees every run and takes no '@runs' scope; scope a trainer, "
            "generator or viewer token instead"
        )
    patterns = tuple(p.strip() for p in text.split("|"))
    if not any(patterns):
        raise ValueError(f"{where}: the run scope after '@' is empty: name run patterns, e.g. {role}@sweep-*|run-a")
    for pattern in patterns:
        # A stray '[' or ']' (or any character a run id cannot hold) would make a pattern that never matches:
        # a token silently locked out of every run, so refuse it.
        if not pattern or not _GLOB_CHARS.match(_BRACKET_SET.sub("x", pattern)):
            raise ValueError(
                f"{where}: run pattern {pattern!r} is not a glob over run ids (letters, digits, '_', '.', '-', "
                "wildcards '*' '?', sets like '[ab]' or '[!ab]'; patterns separated by '|')"
            )
    return patterns


def parse_pairs(text: str, source: str) -> list[TokenEntry]:
    """Parse ``role[@runs]:token`` entries separated by commas or newlines; ValueError naming the bad one."""
    entries: list[TokenEntry] = []
    for raw in text.replace("\n", ",").split(","):
        item = raw.strip()
        if not item or item.startswith("#"):
            continue
        head, sep, token = item.partition(":")
        role, at, scope = head.partition("@")
        role, token = role.strip(), token.strip()
        if not sep or not token:
            raise ValueError(f"{source}: entry {item[:20]!r}... is not 'role:token' (or 'role@runs:token')")
        if role not in ROLES:
            raise ValueError(f"{source}: unknown role {role!r} (expected one of {', '.join(ROLES)})")
        runs = parse_scope(scope, role, f"{source}: {head.strip()!r}") if at else None
        entries.append(TokenEntry(role, token, runs))
    return entries


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class TokenAuth:
    """Maps a bearer token to a :class:`Principal` in constant time."""

    def __init__(self, entries: list[TokenEntry], *, anonymous: bool = False) -> None:
        self._entries = [(Principal(e.role, runs=e.runs), e.token.encode()) for e in entries]
        self.anonymous = anonymous

    @classmethod
    def from_settings(
        cls, tokens: str, tokens_file: str | None, allow_anonymous: bool, host: str, insecure_dev_tokens: bool = False
    ) -> TokenAuth:
        pairs = parse_pairs(tokens, "BUCKETRL_TOKENS")
        if tokens_file:
            path = Path(tokens_file)
            try:
                text = path.read_text()
            except OSError as exc:
                raise ValueError(f"BUCKETRL_TOKENS_FILE={tokens_file!r} cannot be read: {exc}") from exc
            pairs += parse_pairs(text, f"BUCKETRL_TOKENS_FILE={tokens_file}")
        if pairs:
            check_strength(pairs, host, insecure_dev_tokens)
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

    def has_role(self, role: str) -> bool:
        return any(p.role == role for p, _ in self._entries)

    def authenticate(self, authorization: str | None) -> Principal:
        if self.anonymous:
            return Principal("admin", anonymous=True)
        if not authorization:
            raise errors.Unauthorized("missing 'Authorization: Bearer <token>' header")
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise errors.Unauthorized("the Authorization header must be 'Bearer <token>'")
        given = token.strip().encode()
        matched: Principal | None = None
        # Compare against every token so the time taken does not depend on which one matched.
        for principal, expected in self._entries:
            if hmac.compare_digest(given, expected) and matched is None:
                matched = principal
        if matched is None:
            raise errors.Unauthorized("unknown bearer token")
        return matched
