"""Real certificates for the TLS tests (the `cryptography` package): a CA, leaves it signs (server
and client auth, SANs for localhost), expired leaves, a second CA."""

from __future__ import annotations

import datetime
import ipaddress
import os


def make_cert(name, issuer=None, *, ca=False, days=(-1, 30), dns=("localhost",), ips=("127.0.0.1",)):
    """(key, cert): self-signed when `issuer` (key, cert) is None; leaves carry both server and
    client auth (one certificate per config, as the operator issues)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    sign_key, issuer_name = (key, subject) if issuer is None else (issuer[0], issuer[1].subject)
    b = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now + datetime.timedelta(days=days[0]))
        .not_valid_after(now + datetime.timedelta(days=days[1]))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if not ca:
        b = b.add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName(d) for d in dns] + [x509.IPAddress(ipaddress.ip_address(i)) for i in ips]
            ),
            critical=False,
        )
        b = b.add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False
        )
    return key, b.sign(sign_key, hashes.SHA256())


def write_pem(directory, name, key, cert) -> tuple[str, str]:
    """(crt path, key path), each written atomically (a rotation must never show half a file)."""
    from cryptography.hazmat.primitives import serialization

    out = []
    for suffix, data in (
        ("crt", cert.public_bytes(serialization.Encoding.PEM)),
        (
            "key",
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            ),
        ),
    ):
        path = os.path.join(str(directory), f"{name}.{suffix}")
        with open(path + ".tmp", "wb") as f:
            f.write(data)
        os.replace(path + ".tmp", path)
        out.append(path)
    return out[0], out[1]


def make_pki(directory) -> dict[str, tuple[str, str]]:
    """name -> (crt, key): ca, leaf, other_leaf (also by ca), expired (by ca), other_ca, foreign
    (by other_ca)."""
    ca, other = make_cert("config ca", ca=True), make_cert("other ca", ca=True)
    made = {
        "ca": ca,
        "other_ca": other,
        "leaf": make_cert("config", ca),
        "other_leaf": make_cert("config 2", ca),
        "expired": make_cert("config", ca, days=(-30, -1)),
        "foreign": make_cert("config", other),
    }
    return {name: write_pem(directory, name, *pair) for name, pair in made.items()}
