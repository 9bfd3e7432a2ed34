"""A private CA and one server certificate signed by it, as PEM files: what the TLS tests and ``bench/wan.py
--tls`` serve HTTPS with and hand the workers as ``BUCKETRL_CA_FILE``.

``cryptography`` comes with the dev extras (moto's dependency), as the rest of the simulation's tooling does.
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


@dataclass
class Pki:
    ca: Path
    cert: Path
    key: Path


def _cert(
    subject: str,
    key: ec.EllipticCurvePrivateKey,
    issuer: x509.Certificate | None,
    signer: ec.EllipticCurvePrivateKey,
    san: list[x509.GeneralName] | None = None,
) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    builder = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(issuer.subject if issuer else name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=issuer is None, path_length=None), critical=True)
    )
    if issuer is None:  # the CA
        builder = builder.add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        builder = builder.add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True
        )
    else:
        ski = issuer.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
        builder = builder.add_extension(x509.SubjectAlternativeName(san or []), critical=False).add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ski), critical=False
        )
    return builder.sign(signer, hashes.SHA256())


def make_pki(where: Path, ips: tuple[str, ...] = ("127.0.0.1",), names: tuple[str, ...] = ("localhost",)) -> Pki:
    """A CA and a server certificate for ``names`` and ``ips`` signed by it, written under ``where``."""
    ca_key, srv_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = _cert("bucketrl test CA", ca_key, None, ca_key)
    san: list[x509.GeneralName] = [x509.DNSName(n) for n in names]
    san += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ips]
    srv = _cert(names[0] if names else ips[0], srv_key, ca, ca_key, san)
    where.mkdir(parents=True, exist_ok=True)
    pki = Pki(where / "ca.pem", where / "server.pem", where / "server.key")
    pki.ca.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    pki.cert.write_bytes(srv.public_bytes(serialization.Encoding.PEM))
    pki.key.write_bytes(
        srv_key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return pki
