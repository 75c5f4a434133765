"""A Google Cloud service account's key file whose token endpoint is a local server: Application Default
Credentials (GOOGLE_APPLICATION_CREDENTIALS) that google.auth refreshes against it, as it would at Google."""

from __future__ import annotations

import json
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa


def service_account_file(folder: Path, token_uri: str, project: str = "proj-7") -> Path:
    """The key file, written under `folder` (a user's `gcloud auth application-default login` file always
    refreshes at Google, so a test points ADC at one of these)."""
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption()).decode()
    path = Path(folder) / "service-account.json"
    path.write_text(json.dumps({"type": "service_account", "project_id": project, "private_key_id": "k1",
                                "private_key": pem, "client_email": f"runner@{project}.iam.gserviceaccount.com",
                                "client_id": "1", "token_uri": token_uri}))
    return path
