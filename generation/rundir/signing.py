"""C2PA Content Credentials: a signed manifest bound to the bytes of every image a run writes, and its check.

The XMP mark (provenance.py) says an image is synthetic, but anyone can strip or forge it. With a certificate and its
private key, `RunStore.write_attempt` also embeds a C2PA manifest (c2pa-python, the C2PA reference implementation):
its actions name the IPTC digital source type and the models, a medbanana assertion carries the run id, task uid,
round, the instruction's SHA-256 and the source image's SHA-256 (the source is named by its hash only, never
embedded: MIMIC pixels must not travel), and its signature covers the final bytes (XMP mark included), so one
changed pixel makes the manifest invalid. `check_image` reads a manifest back with `c2pa.Reader`, and
`provenance_differences` compares its medbanana assertion with what a record says the image is: a signed image moved
to another task's place is intact but `mismatched`.

The private key is read from its file when signing starts and handed to the native signer; it is never put into the
run configuration (only the certificate's SHA-256 fingerprint is), the journal, a log or an error message.
"""

from __future__ import annotations

import base64
import hashlib
import io
import os
import re
from dataclasses import dataclass
from pathlib import Path

from ..extras import require
from .provenance import IPTC_DST_PREFIX
from ..failures import UsageError

CERT_ENV, KEY_ENV = "MEDBANANA_C2PA_CERT", "MEDBANANA_C2PA_KEY"
ASSERTION_LABEL = "org.medbanana.provenance"
STATUSES = ("valid", "untrusted", "invalid", "missing", "mismatched")
# the medbanana assertion's fields a record can confirm (RunStore._manifest writes them; direction and disease follow
# from the task uid)
PROVENANCE_FIELDS = ("run_id", "task_uid", "round", "accepted", "instruction_sha256", "source_sha256")
_PEM_CERT = re.compile(rb"-----BEGIN CERTIFICATE-----(.+?)-----END CERTIFICATE-----", re.S)
_PEM_ANY = re.compile(r"-----BEGIN [A-Z ]+-----.*?(-----END [A-Z ]+-----|$)", re.S)
# reading is all the checker does: no thumbnail on signing, no re-read after signing (the tests read back instead)
_SIGNING_SETTINGS = {"builder": {"thumbnail": {"enabled": False}}, "verify": {"verify_after_sign": False}}


class SigningError(UsageError):
    """Missing, unreadable or mismatched certificate / key, or c2pa refusing them (one line, never key material)."""


def require_c2pa():
    """The c2pa module, or an ImportError with the pip hint."""
    return require("c2pa", needed_for="C2PA signing and checking", extra="c2pa")


def without_pem(text: str) -> str:
    """`text` with any PEM block cut out: what a library says about a key must not repeat the key."""
    return _PEM_ANY.sub("[PEM removed]", text)


def certificate_fingerprint(chain_pem: bytes) -> str:
    """SHA-256 (hex) of the DER of the first certificate in a PEM chain: the signing certificate."""
    match = _PEM_CERT.search(chain_pem)
    if not match:
        raise SigningError("no PEM certificate (-----BEGIN CERTIFICATE-----) in the certificate file")
    return hashlib.sha256(base64.b64decode(b"".join(match.group(1).split()))).hexdigest()


@dataclass(frozen=True)
class SigningCredentials:
    """Where the signing certificate chain and its private key are: paths only, so this is safe to log, pickle
    and record (the key is read by `ImageSigner` and nowhere else)."""

    cert: Path  # PEM: the signing certificate first, then its issuers
    key: Path  # PEM: the signing certificate's private key (PKCS#8 or SEC1, unencrypted)

    @classmethod
    def from_options(cls, cert: str | Path | None, key: str | Path | None,
                     environ: dict | None = None) -> "SigningCredentials | None":
        """From --c2pa-cert / --c2pa-key, else MEDBANANA_C2PA_CERT / MEDBANANA_C2PA_KEY; None when neither is set
        (no signing). Half a pair, or a file that is not there, is a SigningError."""
        environ = os.environ if environ is None else environ
        cert = cert or environ.get(CERT_ENV) or None
        key = key or environ.get(KEY_ENV) or None
        if cert is None and key is None:
            return None
        if cert is None or key is None:
            raise SigningError(f"C2PA signing needs both a certificate chain and its key: give --c2pa-cert and "
                               f"--c2pa-key (or {CERT_ENV} and {KEY_ENV}); `medbanana keys init DIR` makes a pair")
        for what, path in (("certificate chain", cert), ("private key", key)):
            if not Path(path).is_file():
                raise SigningError(f"C2PA {what} {path}: no such file")
        return cls(Path(cert), Path(key))

    def chain_pem(self) -> bytes:
        return self.cert.read_bytes()

    def describe(self) -> dict:
        """What the run configuration records: the certificate's fingerprint, never the key."""
        chain = self.chain_pem()
        return {"certificate_sha256": certificate_fingerprint(chain), "algorithm": signing_algorithm(chain)}


def signing_algorithm(chain_pem: bytes) -> str:
    """The C2PA algorithm name for the signing certificate's public key (ES256 for P-256, as `keys init` makes)."""
    from cryptography import x509
    from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa

    public = x509.load_pem_x509_certificate(chain_pem).public_key()
    if isinstance(public, ec.EllipticCurvePublicKey):
        algorithms = {"secp256r1": "es256", "secp384r1": "es384", "secp521r1": "es512"}
        if public.curve.name in algorithms:
            return algorithms[public.curve.name]
    elif isinstance(public, rsa.RSAPublicKey):
        return "ps256"
    elif isinstance(public, ed25519.Ed25519PublicKey):
        return "ed25519"
    raise SigningError("the signing certificate's key type is not one C2PA signs with (EC P-256/384/521, RSA, "
                       "Ed25519)")


class ImageSigner:
    """Signs image bytes with a C2PA manifest. Built once per run (the key is read here, checked against the
    certificate, handed to the native signer and not kept in Python)."""

    def __init__(self, credentials: SigningCredentials):
        c2pa = require_c2pa()
        from cryptography.hazmat.primitives import serialization
        from cryptography import x509

        self.credentials = credentials
        chain = credentials.chain_pem()
        self.fingerprint = certificate_fingerprint(chain)
        self.algorithm = signing_algorithm(chain)
        try:
            key = serialization.load_pem_private_key(credentials.key.read_bytes(), password=None)
        except (ValueError, TypeError):
            raise SigningError(f"C2PA private key {credentials.key}: not an unencrypted PEM private key") from None
        public = serialization.PublicFormat.SubjectPublicKeyInfo
        if (key.public_key().public_bytes(serialization.Encoding.DER, public)
                != x509.load_pem_x509_certificate(chain).public_key().public_bytes(serialization.Encoding.DER, public)):
            raise SigningError(f"C2PA private key {credentials.key} does not belong to the certificate in "
                               f"{credentials.cert}")
        pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
        try:
            self._signer = c2pa.Signer.from_info(c2pa.C2paSignerInfo(self.algorithm.encode(), chain, pem, None))
            self._context = c2pa.Context.from_dict(_SIGNING_SETTINGS)
        except c2pa.C2paError as exc:
            raise SigningError(f"c2pa refused the certificate {credentials.cert}: {without_pem(str(exc))}") from None
        finally:
            del pem, key

    def describe(self) -> dict:
        return {"certificate_sha256": self.fingerprint, "algorithm": self.algorithm}

    def sign(self, data: bytes, manifest: dict) -> bytes:
        """`data` (JPEG or PNG) with `manifest` embedded and signed; the pixels and other segments are kept."""
        import c2pa

        mime = image_mime(data)
        builder = c2pa.Builder.from_json({**manifest, "format": mime}, context=self._context)  # the bytes' own format
        out = io.BytesIO()
        try:
            builder.sign(self._signer, mime, io.BytesIO(data), out)
        except c2pa.C2paError as exc:
            raise SigningError(f"C2PA signing failed: {without_pem(str(exc))}") from None
        return out.getvalue()

    def close(self) -> None:
        for resource in (self._signer, self._context):
            resource.close()


def image_mime(data: bytes) -> str:
    if data[:2] == b"\xff\xd8":
        return "image/jpeg"
    if data[:8] == b"\x89PNG\r\n\x1a\n":
        return "image/png"
    raise SigningError("C2PA signing needs JPEG or PNG bytes")


def image_manifest(*, title: str, source_type: str, models: dict, generator: str, provenance: dict) -> dict:
    """The manifest of one generated image. No parent ingredient (the source is named by its SHA-256 in the
    medbanana assertion, never embedded), so the image is a C2PA creation: `c2pa.created` with the IPTC digital
    source type by medbanana, then `c2pa.edited` with the editor model as its software agent (every role's model
    id in its parameters)."""
    dst = IPTC_DST_PREFIX + source_type
    actions = [{"action": "c2pa.created", "digitalSourceType": dst, "softwareAgent": {"name": generator},
                "description": "Synthetic medical image: not a real patient image; not for diagnosis."},
               {"action": "c2pa.edited", "digitalSourceType": dst,
                "softwareAgent": {"name": str((models or {}).get("editor", generator))},
                "description": "A source scan (named by its SHA-256 only) edited by the editor model",
                "parameters": {"org.medbanana.models": {str(k): str(v) for k, v in sorted((models or {}).items())}}}]
    return {"claim_generator_info": [{"name": generator}], "title": title,
            "assertions": [{"label": "c2pa.actions.v2", "data": {"actions": actions}},
                           {"label": ASSERTION_LABEL, "data": provenance}]}


# --- checking ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CheckResult:
    status: str  # one of STATUSES
    failures: tuple[str, ...] = ()  # the validator's failure codes, e.g. assertion.dataHash.mismatch
    provenance: dict | None = None  # the intact manifest's medbanana assertion (valid and untrusted only)


def reading_settings(trust_pem: bytes | str | None) -> dict:
    """c2pa settings for checking: with trust anchors (PEM), the signer's chain must lead to one of them."""
    if trust_pem is None:
        return {"verify": {"verify_trust": False}}
    text = trust_pem.decode() if isinstance(trust_pem, bytes) else trust_pem
    return {"verify": {"verify_trust": True}, "trust": {"trust_anchors": text}}


def reading_context(trust_pem: bytes | str | None = None):
    return require_c2pa().Context.from_dict(reading_settings(trust_pem))


def check_image(data: bytes, context, trusting: bool) -> CheckResult:
    """valid (Trusted with anchors; signature and hashes good without), untrusted (good, but no anchor leads to
    the signer), invalid (a hash or the signature does not match, or the manifest cannot be read), missing."""
    import c2pa

    try:
        reader = c2pa.Reader.try_create(image_mime(data), io.BytesIO(data), context=context)
    except (c2pa.C2paError, SigningError) as exc:
        return CheckResult("invalid", (type(exc).__name__,))
    if reader is None:
        return CheckResult("missing")
    try:
        state = reader.get_validation_state()
        results = reader.get_validation_results() or {}
        provenance = _assertion(reader) if state in ("Trusted", "Valid") else None
    finally:
        reader.close()
    failures = tuple(f.get("code", "") for f in (results.get("activeManifest") or {}).get("failure", []))
    if state == "Trusted" or (state == "Valid" and not trusting):
        return CheckResult("valid", failures if trusting else (), provenance)
    if state == "Valid":
        return CheckResult("untrusted", failures, provenance)
    return CheckResult("invalid", failures)


def _assertion(reader) -> dict:
    """The active manifest's medbanana assertion; {} when it has none (signed by someone else's tool)."""
    try:
        manifest = reader.get_active_manifest() or {}
    except KeyError:
        return {}
    found = next((a.get("data") for a in manifest.get("assertions") or [] if a.get("label") == ASSERTION_LABEL), None)
    return found if isinstance(found, dict) else {}


def provenance_differences(signed: dict, expected: dict) -> list[str]:
    """Each field of `expected` (PROVENANCE_FIELDS; None: the record does not say) that the signed assertion
    contradicts, as `field signed X, recorded Y` (values from data: repr, cut short; hashes to 12 digits)."""
    if not signed:
        return [f"no {ASSERTION_LABEL} assertion"]

    def show(name, value):
        hexdigest = name.endswith("_sha256") and isinstance(value, str) and value.isascii() and value.isalnum()
        return f"{value[:12]}..." if hexdigest else f"{value!r:.70}"

    return [f"{name} signed {show(name, signed.get(name))}, recorded {show(name, want)}"
            for name, want in expected.items() if want is not None and signed.get(name) != want]
