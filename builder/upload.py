"""Upload a built dataset folder to the Hugging Face Hub: `HfApi.upload_folder`, the path `hf upload` takes.

The endpoint comes from `HF_ENDPOINT` (default the Hub), the token from `HF_TOKEN` or the stored `hf auth login`;
it is never printed: an endpoint may echo the request's headers in an error body, so every message is scrubbed
(generation/secrets.py). A refused request or an unreachable endpoint is one `UploadError` line naming the step,
the endpoint and what to check. The folder's SHA256SUMS is checked first, so a damaged build is never published.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..generation.secrets import hold, scrub
from .manifest import verify_manifest

# Exception modules of the HTTP stacks huggingface_hub may use: their errors mean the endpoint was not reached.
_NETWORK_MODULES = {"httpx", "httpx2", "httpcore", "httpcore2", "requests", "urllib3", "ssl", "socket"}
_CHECK = {401: "that HF_TOKEN (or `hf auth login`) holds a valid token",
          403: "that the token may write to {repo} (a write token, the organisation's permissions)",
          404: "the repository id and HF_ENDPOINT"}


class UploadError(Exception):
    """The folder cannot be uploaded as it is, or the Hub refused it or could not be reached."""


def upload(folder: Path, repo_id: str, *, private: bool = False, revision: str | None = None,
           commit_message: str | None = None) -> str:
    """Create the dataset repo if needed and upload the folder in one commit; returns the commit URL."""
    from huggingface_hub import HfApi, get_token

    folder = Path(folder)
    report = verify_manifest(folder)
    if not report.ok:
        raise UploadError(f"{folder} does not match its manifest, rebuild it before uploading: {report.describe()}")
    hold(get_token())  # a token from `hf auth login` is in no variable: scrub must know it all the same
    api = HfApi(endpoint=os.environ.get("HF_ENDPOINT"))  # read now: huggingface_hub reads it once, at import
    step = f"creating the dataset repository {repo_id}"
    try:
        api.create_repo(repo_id, repo_type="dataset", private=private, exist_ok=True)
        if revision:
            step = f"creating the branch {revision}"
            api.create_branch(repo_id, repo_type="dataset", branch=revision, exist_ok=True)
        step = f"uploading {folder.name}"
        commit = api.upload_folder(folder_path=folder, repo_id=repo_id, repo_type="dataset", revision=revision,
                                   commit_message=commit_message or f"Upload {folder.name} (medbanana build)",
                                   ignore_patterns=[".*", "**/.*"])
    except Exception as exc:  # a refusal or a network failure becomes one line; anything else is a bug, re-raised
        failure = hub_failure(exc, step, api.endpoint, repo_id)
        if failure is None:
            raise
        raise failure from None
    return commit.commit_url


def hub_failure(exc: BaseException, step: str, endpoint: str, repo_id: str) -> UploadError | None:
    """An HTTP error status or a network failure as one scrubbed line: what failed, where, what to check."""
    from huggingface_hub.errors import HfHubHTTPError

    if isinstance(exc, HfHubHTTPError) and exc.response is not None:
        code = exc.response.status_code
        said = _one_line(exc.server_message or "")[:200]
        check = _CHECK.get(code, "the Hub's status page, then try again" if code >= 500 else "HF_ENDPOINT and the "
                           "token").format(repo=repo_id)
        return UploadError(_one_line(f"{step} failed: {endpoint} answered HTTP {code}"
                                     f"{f' ({said})' if said else ''}; check {check}"))
    if isinstance(exc, (ConnectionError, TimeoutError)) or type(exc).__module__.split(".")[0] in _NETWORK_MODULES:
        return UploadError(_one_line(f"{step} failed: could not reach {endpoint} ({type(exc).__name__}: {exc}); "
                                     "check HF_ENDPOINT and the network (proxy, firewall)"))
    return None


def _one_line(text: str) -> str:
    return scrub(" ".join(text.split()))
