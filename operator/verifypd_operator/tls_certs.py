"""Certificates for a config's TLS (docs/kubernetes.md "TLS"), issued by the operator itself:
one CA per config and one leaf certificate per config that the gateway and every lane present
(server and client auth). Pure functions over PEM bytes and a clock; no Kubernetes client.

    new_ca(config, now)                         -> (key PEM, cert PEM)
    new_leaf(ca_key, ca_cert, names, now, days) -> (key PEM, cert PEM)
    renewal_reason(cert, ca_cert, names, now)   -> why the leaf must be re-issued, or None
    plan(ca_pair, leaf_pair, names, now, days)  -> TlsPlan: what the two Secrets must hold

Why a CA per config: a leaf of one config is then refused by the lanes of every other config
(the wrong-CA case), and deleting the config deletes its whole trust (the Secrets are owned by
it). The CA lives 10 years and is not rotated by the operator; the leaf lives `days` and is
re-issued once less than a third of its life is left, so a pod that misses one update (kubelet
refreshes Secret volumes within about a minute) still has weeks of valid certificate.
"""

from __future__ import annotations

import dataclasses
import datetime
import ipaddress
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: cryptography itself is imported inside the functions that use it
    from cryptography.hazmat.primitives.asymmetric.types import CertificateIssuerPrivateKeyTypes, PublicKeyTypes

CA_DAYS = 3650
RENEW_FRACTION = 1 / 3  # re-issue when less than this part of the leaf's validity is left
BACKDATE = datetime.timedelta(minutes=5)  # clock skew between the operator and the pods


def _now(now: float) -> datetime.datetime:
    return datetime.datetime.fromtimestamp(now, datetime.UTC)


def _key():
    from cryptography.hazmat.primitives.asymmetric import ec

    return ec.generate_private_key(ec.SECP256R1())


def _pem_key(key) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _same_public_key(a: PublicKeyTypes, b: PublicKeyTypes) -> bool:
    """Whether two public keys (any algorithm) are the same key: their SubjectPublicKeyInfo DER."""
    from cryptography.hazmat.primitives import serialization

    enc, fmt = serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    return a.public_bytes(enc, fmt) == b.public_bytes(enc, fmt)


def _load_issuer_key(pem: bytes) -> CertificateIssuerPrivateKeyTypes:
    """The CA's private key from PEM; TypeError when its algorithm cannot sign certificates."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import dsa, ec, ed448, ed25519, rsa

    key = serialization.load_pem_private_key(pem, None)
    issuer_types = (
        ec.EllipticCurvePrivateKey,
        rsa.RSAPrivateKey,
        dsa.DSAPrivateKey,
        ed25519.Ed25519PrivateKey,
        ed448.Ed448PrivateKey,
    )
    if not isinstance(key, issuer_types):
        raise TypeError(f"a {type(key).__name__} cannot sign certificates")
    return key


def _pem_cert(cert) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return cert.public_bytes(serialization.Encoding.PEM)


def new_ca(config: str, now: float) -> tuple[bytes, bytes]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import NameOID

    key = _key()
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"verifypd {config} CA"[:64])])
    start = _now(now) - BACKDATE
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(start + datetime.timedelta(days=CA_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(key, hashes.SHA256())
    )
    return _pem_key(key), _pem_cert(cert)


def _san(names: list[str]):
    from cryptography import x509

    out: list[x509.GeneralName] = []
    for n in names:
        try:
            out.append(x509.IPAddress(ipaddress.ip_address(n)))
        except ValueError:
            out.append(x509.DNSName(n))
    return x509.SubjectAlternativeName(out)


def new_leaf(ca_key_pem: bytes, ca_cert_pem: bytes, names: list[str], now: float, days: int) -> tuple[bytes, bytes]:
    """A leaf for every name in `names` (DNS names and IP addresses), server and client auth."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    ca_key = _load_issuer_key(ca_key_pem)
    ca_cert = x509.load_pem_x509_certificate(ca_cert_pem)
    key = _key()
    start = _now(now) - BACKDATE
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0][:64])]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(start + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_san(names), critical=False)
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    return _pem_key(key), _pem_cert(cert)


def renewal_reason(
    cert_pem: bytes | None, key_pem: bytes | None, ca_cert_pem: bytes, names: list[str], now: float
) -> str | None:
    """Why the live leaf cannot stay (None: it can): missing, unreadable, not issued by this CA,
    not naming exactly `names`, or less than RENEW_FRACTION of its validity left."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    if not cert_pem or not key_pem:
        return "no certificate yet"
    try:
        cert = x509.load_pem_x509_certificate(cert_pem)
        key = serialization.load_pem_private_key(key_pem, None)
        ca = x509.load_pem_x509_certificate(ca_cert_pem)
    except ValueError as exc:
        return f"unreadable: {exc}"
    if cert.issuer != ca.subject:
        return "not issued by the config's CA"
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, Exception) as exc:  # InvalidSignature is not a ValueError
        return f"not signed by the config's CA ({type(exc).__name__})"
    if not _same_public_key(key.public_key(), cert.public_key()):
        return "key does not match the certificate"
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        have = {str(v) for v in san.get_values_for_type(x509.DNSName)} | {
            str(v) for v in san.get_values_for_type(x509.IPAddress)
        }
    except x509.ExtensionNotFound:
        have = set()
    if have != set(names):
        return "names changed"
    start, end = cert.not_valid_before_utc, cert.not_valid_after_utc
    left = end - _now(now)
    if left <= (end - start) * RENEW_FRACTION:
        return f"expires {end.isoformat()}" if left.total_seconds() > 0 else f"expired {end.isoformat()}"
    return None


def ca_usable(ca_key_pem: bytes | None, ca_cert_pem: bytes | None, now: float) -> bool:
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    if not ca_key_pem or not ca_cert_pem:
        return False
    try:
        key = serialization.load_pem_private_key(ca_key_pem, None)
        cert = x509.load_pem_x509_certificate(ca_cert_pem)
    except ValueError:
        return False
    valid_for_a_day = cert.not_valid_after_utc > _now(now) + datetime.timedelta(days=1)
    return _same_public_key(key.public_key(), cert.public_key()) and valid_for_a_day


@dataclasses.dataclass(frozen=True)
class TlsPlan:
    ca_key: bytes
    ca_cert: bytes
    leaf_key: bytes
    leaf_cert: bytes
    reason: str | None  # None: the live Secrets stay as they are


def plan(
    ca: tuple[bytes | None, bytes | None],
    leaf: tuple[bytes | None, bytes | None],
    config: str,
    names: list[str],
    now: float,
    days: int,
) -> TlsPlan:
    """What the CA and leaf Secrets must hold: the live ones when still good, else new ones.
    `ca`, `leaf`: (key PEM, cert PEM) as read from the live Secrets (None where absent)."""
    ca_key, ca_cert = ca
    if ca_key is None or ca_cert is None or not ca_usable(ca_key, ca_cert, now):
        new_ca_key, new_ca_cert = new_ca(config, now)
        leaf_key, leaf_cert = new_leaf(new_ca_key, new_ca_cert, names, now, days)
        return TlsPlan(new_ca_key, new_ca_cert, leaf_key, leaf_cert, "issued a new CA")
    live_key, live_cert = leaf
    reason = renewal_reason(live_cert, live_key, ca_cert, names, now)
    if reason is None and live_key and live_cert:  # (renewal_reason passes only a present pair)
        return TlsPlan(ca_key, ca_cert, live_key, live_cert, None)
    leaf_key, leaf_cert = new_leaf(ca_key, ca_cert, names, now, days)
    return TlsPlan(ca_key, ca_cert, leaf_key, leaf_cert, f"re-issued the certificate: {reason}")
