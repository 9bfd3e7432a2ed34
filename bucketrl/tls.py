"""How a worker's HTTP clients reach the proxy safely: which CA they trust, and no plain HTTP off this host.

Bearer tokens ride on every request, so a worker refuses ``http://`` to any host but loopback (127.0.0.0/8,
``::1``, ``localhost``) unless ``BUCKETRL_INSECURE_HTTP=1`` says it is on purpose (the shipped Compose file and
chart set it for their in-network Service names). ``https://`` is verified against ``BUCKETRL_CA_FILE`` (a
PEM bundle: a private CA) when set, else against the operating system's store plus certifi's public roots (a
slim image without ``ca-certificates`` still verifies a public certificate).

Every client to the proxy (:class:`bucketrl.client.ProxyClient`, the simulated fleet, ``bucketrl up``'s
watchers) takes its ``verify=`` from :meth:`TransportSecurity.verify`; the check runs when a client or a worker's
settings are built, so a misconfigured worker exits at start with the URL and the setting in its message.
"""

from __future__ import annotations

import functools
import ipaddress
import os
import ssl
from dataclasses import dataclass
from urllib.parse import urlsplit

import certifi  # httpx's own dependency

CA_FILE_ENV = "BUCKETRL_CA_FILE"
INSECURE_ENV = "BUCKETRL_INSECURE_HTTP"
_TRUE = {"1", "true", "yes", "on"}


def is_loopback(host: str) -> bool:
    """``localhost`` or a loopback address: traffic that never leaves the machine."""
    host = host.strip("[]").lower()
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class TransportSecurity:
    """The TLS policy of one worker: ``ca_file`` (empty = system store) and whether plain HTTP is allowed."""

    ca_file: str = ""
    insecure_http: bool = False

    @classmethod
    def from_env(cls) -> TransportSecurity:
        return cls(
            ca_file=os.environ.get(CA_FILE_ENV, ""),
            insecure_http=os.environ.get(INSECURE_ENV, "").strip().lower() in _TRUE,
        )

    def check(self, url: str) -> None:
        """Raise ``ValueError`` naming the URL and the setting for plain HTTP to a host off this machine."""
        parts = urlsplit(url)
        if parts.scheme == "http" and not self.insecure_http and not is_loopback(parts.hostname or ""):
            raise ValueError(
                f"refusing plain HTTP to {url}: bearer tokens would cross the network unencrypted. Use https:// "
                f"(with {CA_FILE_ENV} for a private CA), or set {INSECURE_ENV}=1 if this network is private on "
                "purpose"
            )
        if self.ca_file and not os.path.isfile(self.ca_file):
            raise ValueError(f"{CA_FILE_ENV}={self.ca_file} is not a readable file")

    def verify(self) -> ssl.SSLContext:
        """The SSL context httpx verifies the proxy's certificate with (built once per CA file per process)."""
        return _context(self.ca_file)


def server_pair_problem(cert: tuple[str, str], key: tuple[str, str]) -> str | None:
    """What is wrong with a server's (setting name, path) certificate and key, if anything: both or neither,
    each a file."""
    if bool(cert[1]) != bool(key[1]):
        return f"{cert[0]} and {key[0]} must be set together (or neither)"
    for name, path in (cert, key):
        if path and not os.path.isfile(path):
            return f"{name}={path} is not a readable file"
    return None


def verification_failure(exc: BaseException) -> str | None:
    """The reason, when ``exc`` (an httpx transport error) is the server's certificate failing verification."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, ssl.SSLCertVerificationError):
            return seen.verify_message or str(seen)
        seen = seen.__cause__ or seen.__context__
    return "certificate verify failed" if "CERTIFICATE_VERIFY_FAILED" in str(exc) else None


@functools.cache
def _context(ca_file: str) -> ssl.SSLContext:
    if ca_file:
        return ssl.create_default_context(cafile=ca_file)
    ctx = ssl.create_default_context()  # the operating system's store
    ctx.load_verify_locations(cafile=certifi.where())
    return ctx
