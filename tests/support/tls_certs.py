"""A throwaway CA, a server certificate for localhost/127.0.0.1 and a client certificate,
written as PEM files for the TLS tests (EC P-256: quick to make)."""

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class TlsFiles:
    """Paths of the PEM files one `make_tls_files` call wrote."""

    # The CA certificate that signed both others.
    ca: Path
    # Server certificate (SAN localhost and 127.0.0.1) and its key.
    server_cert: Path
    server_key: Path
    # Client certificate (for mutual TLS) and its key.
    client_cert: Path
    client_key: Path


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _certificate(subject: str, key: ec.EllipticCurvePrivateKey, issuer: x509.Name,
                 signer: ec.EllipticCurvePrivateKey, *, ca: bool = False,
                 usage: x509.ObjectIdentifier | None = None) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    builder = (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(issuer)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if usage is not None:
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    if usage == ExtendedKeyUsageOID.SERVER_AUTH:
        builder = builder.add_extension(x509.SubjectAlternativeName([
            x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False)
    return builder.sign(signer, hashes.SHA256())


def _write(folder: Path, name: str, cert: x509.Certificate,
           key: ec.EllipticCurvePrivateKey) -> tuple[Path, Path]:
    cert_path, key_path = folder / f"{name}.pem", folder / f"{name}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    key_path.chmod(0o600)
    return cert_path, key_path


def make_tls_files(folder: Path) -> TlsFiles:
    """Make the CA and both certificates in `folder`."""
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_cert = _certificate("pagedkv test CA", ca_key, _name("pagedkv test CA"), ca_key, ca=True)
    ca_path, _ = _write(folder, "ca", ca_cert, ca_key)
    paths = {}
    for who, usage in (("server", ExtendedKeyUsageOID.SERVER_AUTH),
                       ("client", ExtendedKeyUsageOID.CLIENT_AUTH)):
        key = ec.generate_private_key(ec.SECP256R1())
        paths[who] = _write(folder, who, _certificate(f"pagedkv {who}", key, ca_cert.subject,
                                                      ca_key, usage=usage), key)
    return TlsFiles(ca_path, *paths["server"], *paths["client"])
