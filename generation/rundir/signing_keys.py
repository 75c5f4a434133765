"""`medbanana keys init DIR`: a local certificate authority and an ES256 signing certificate for C2PA.

For users without an organisational certificate. C2PA validators require of the signing certificate: key usage
digitalSignature, an extended key usage they accept (emailProtection here, which c2pa-rs' default list accepts),
subject and authority key identifiers, and an issuer that is a CA (basic constraints CA:true). The CA's private key
is used once, to issue the signing certificate, and not written: nobody can issue another certificate under this CA,
and the only secret on disk is the signing key (mode 0600).

No file is written through a symbolic link: a link at one of the three names (dangling or not) counts as an existing
file and is refused; with `force` it is replaced by the file (files.atomic_write_bytes), its target left untouched.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from pathlib import Path

from ..extras import require
from ..files import atomic_write_bytes
from .signing import certificate_fingerprint
from ..failures import UsageError

CA_CERT, CHAIN, KEY = "ca.pem", "signer-chain.pem", "signer.key"


@dataclass(frozen=True)
class KeyFiles:
    ca: Path  # give to `verify --c2pa --trust`, and to anyone who checks the images
    chain: Path  # --c2pa-cert: the signing certificate, then the CA
    key: Path  # --c2pa-key: keep it private
    fingerprint: str  # SHA-256 of the signing certificate, as recorded in runs and dataset cards


def _require_cryptography():
    require("cryptography.x509", needed_for="`medbanana keys init`", extra="c2pa")


def init_keys(folder: Path, *, name: str = "medbanana signer", organisation: str = "medbanana user",
              days: int = 825, force: bool = False) -> KeyFiles:
    """Write ca.pem, signer-chain.pem and signer.key (0600) into `folder`; existing files are refused unless
    `force`."""
    _require_cryptography()
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    folder = Path(folder)
    paths = [folder / n for n in (CA_CERT, CHAIN, KEY)]
    present = [p.name + (" (a symbolic link)" if p.is_symlink() else "") for p in paths if os.path.lexists(p)]
    if present and not force:
        raise FileExistsError(f"{folder} already holds {', '.join(present)}; use another folder or --force to "
                              f"replace them")
    if days < 1:
        raise UsageError("--days must be at least 1")
    now = datetime.datetime.now(datetime.timezone.utc)

    def subject(common_name: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name),
                          x509.NameAttribute(NameOID.ORGANIZATION_NAME, organisation)])

    def usage(**true) -> x509.KeyUsage:
        names = ("digital_signature", "content_commitment", "key_encipherment", "data_encipherment",
                 "key_agreement", "key_cert_sign", "crl_sign", "encipher_only", "decipher_only")
        return x509.KeyUsage(**{n: true.get(n, False) for n in names})

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = subject(f"{name} CA")
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number())
          .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=days))
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(usage(digital_signature=True, key_cert_sign=True, crl_sign=True), critical=True)
          .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    leaf = (x509.CertificateBuilder().subject_name(subject(name)).issuer_name(ca_name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(usage(digital_signature=True), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.EMAIL_PROTECTION]), critical=False)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    pem = lambda cert: cert.public_bytes(serialization.Encoding.PEM)  # noqa: E731
    # each written to a new file renamed into place: a link at the name is replaced, never written through, and
    # the key is created 0600 from the start, never readable by others, not even for a moment
    atomic_write_bytes(folder / CA_CERT, pem(ca))
    atomic_write_bytes(folder / CHAIN, pem(leaf) + pem(ca))
    key_path = folder / KEY
    atomic_write_bytes(key_path, key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                   serialization.NoEncryption()), mode=0o600)
    return KeyFiles(folder / CA_CERT, folder / CHAIN, key_path, certificate_fingerprint(pem(leaf)))
