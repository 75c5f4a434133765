"""Upload a built dataset folder to the Hugging Face Hub so that the repository is never half-published.

The remote listing is compared with the folder's SHA256SUMS first: nothing differs, nothing is sent ("up to date").
Otherwise the data files that differ (parquet shards, the figure) are uploaded ahead (`HfApi.preupload_lfs_files`:
their contents reach the Hub's storage but no revision names them), then ONE commit (`HfApi.create_commit`) adds
them with the card and the manifest (README.md, medbanana-build.json, SHA256SUMS) and deletes this dataset's remote
files the manifest no longer lists (stale shards that `sft/train-*.parquet` would still match). A reader sees the
previous revision or the new one, never a mix; an upload interrupted before that commit leaves the previous dataset
as it was, and re-running the same command sends it again (content already uploaded is not sent twice).

Only files the build writes are ever deleted: `*.parquet` under the config folders (sft/, failed/, dpo_pairs/,
conversations/, judge/) and the root files README.md, medbanana-build.json, SHA256SUMS, figure3.png. Anything else a
user put in the repository (.gitattributes, notes, other folders, non-parquet files in a config folder) is kept.

Visibility is sent only when asked for (`private=True`/`False`); `None` leaves a new repository to the account's or
organisation's default, and an existing repository keeps its visibility either way; but `--private` into an
existing public repository is refused before anything is sent (medical data must not go public by mistake).

The endpoint comes from `HF_ENDPOINT` (default the Hub), the token from `HF_TOKEN` or the stored `hf auth login`;
it is never printed: an endpoint may echo the request's headers in an error body, so every message is scrubbed
(generation/secrets.py). A refused request or an unreachable endpoint is one `UploadError` line naming the step,
the endpoint and what to check. The folder's SHA256SUMS is checked first, so a damaged build is never published.
"""

from __future__ import annotations

import hashlib
import os
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from ..generation.dataset.configs import PUBLISHED_CONFIGS
from ..generation.dataset.folder import BUILD_INFO, CARD
from ..generation.dataset.hub import unreachable
from ..generation.dataset.manifest import MANIFEST, read_manifest, sha256_file, verify_manifest
from ..generation.dataset.output import OWN_FILES
from ..generation.secrets import hold, scrub

# Written last, in one commit: they name the data files, so they must never point at files not yet there.
CARD_FILES = (CARD, BUILD_INFO, MANIFEST)
# Root files the build writes: a remote one the build no longer has is stale.
_BUILD_ROOT_FILES = OWN_FILES
_RESUME = "; the published dataset is unchanged until the one commit lands: run the same command again to resume"

_CHECK = {401: "that HF_TOKEN (or `hf auth login`) holds a valid token",
          403: "that the token may write to {repo} (a write token, the organisation's permissions)",
          404: "the repository id and HF_ENDPOINT"}


class UploadError(Exception):
    """The folder cannot be uploaded as it is, or the Hub refused it or could not be reached."""


@dataclass
class UploadResult:
    url: str  # the final commit, or the repository when nothing was sent
    files: int  # files in the folder
    sent: list[str] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)

    @property
    def up_to_date(self) -> bool:
        return not (self.sent or self.deleted)


def built_by_medbanana(path: str) -> bool:
    """A repository path the build writes: the only kind `upload` may delete."""
    top, _, rest = path.partition("/")
    return path in _BUILD_ROOT_FILES or (top in PUBLISHED_CONFIGS and rest.endswith(".parquet"))


def plan(local: dict[str, tuple[str, Path]], remote: dict[str, tuple[str | None, str]]
         ) -> tuple[list[str], list[str]]:
    """(local paths the remote lacks or holds different, remote files of this dataset no longer built).

    `local`: path -> (sha256, file); `remote`: path -> (LFS sha256 or None, git blob id). LFS files are compared by
    sha256 (from the manifest, no read), regular ones by git blob id, as the Hub's listing gives them.
    """
    changed = []
    for path, (sha256, file) in local.items():
        lfs_sha256, blob_id = remote.get(path, (None, None))
        same = lfs_sha256 == sha256 if lfs_sha256 else blob_id is not None and blob_id == _git_blob_id(file)
        if not same:
            changed.append(path)
    stale = sorted(p for p in remote if p not in local and built_by_medbanana(p))
    return changed, stale


def upload(folder: Path, repo_id: str, *, private: bool | None = None, revision: str | None = None,
           commit_message: str | None = None) -> UploadResult:
    """Create the dataset repo if needed and publish the folder: data first, card and manifest last."""
    from huggingface_hub import CommitOperationAdd, CommitOperationDelete, HfApi, get_token

    folder = Path(folder)
    report = verify_manifest(folder)
    if not report.ok:
        raise UploadError(f"{folder} does not match its manifest, rebuild it before uploading: {report.describe()}")
    local = dict(read_manifest(folder))
    local[MANIFEST] = (sha256_file(folder / MANIFEST), folder / MANIFEST)
    hold(get_token())  # a token from `hf auth login` is in no variable: scrub must know it all the same
    api = HfApi(endpoint=os.environ.get("HF_ENDPOINT"))  # read now: huggingface_hub reads it once, at import
    message = commit_message or f"Upload {folder.name} (medbanana build)"
    step, resume = f"creating the dataset repository {repo_id}", ""
    try:
        repo_url = api.create_repo(repo_id, repo_type="dataset", private=private, exist_ok=True)
        if private:  # an existing repository keeps its visibility: never publish into a public one by mistake
            step = f"checking the visibility of {repo_id}"
            if not api.repo_info(repo_id, repo_type="dataset").private:
                raise UploadError(f"--private: the dataset repository {repo_id} already exists and is public; "
                                  f"nothing was uploaded. Make it private on the Hub (its settings) and run this "
                                  f"again, or upload with --public if it is meant to be public")
        if revision:
            step = f"creating the branch {revision}"
            api.create_branch(repo_id, repo_type="dataset", branch=revision, exist_ok=True)
        step = f"listing the files of {repo_id}"
        changed, stale = plan(local, _remote_files(api, repo_id, revision))
        result = UploadResult(url=str(repo_url), files=len(local), sent=changed, deleted=stale)
        resume = _RESUME
        data = [CommitOperationAdd(path_in_repo=p, path_or_fileobj=folder / p) for p in changed
                if p not in CARD_FILES]
        card = [CommitOperationAdd(path_in_repo=p, path_or_fileobj=folder / p) for p in changed if p in CARD_FILES]
        if data:
            step = f"uploading {len(data)} data file(s) of {folder.name} ahead of the commit"
            api.preupload_lfs_files(repo_id, additions=data, repo_type="dataset", revision=revision)
        step = f"publishing {folder.name} in one commit"
        commit = api.create_commit(repo_id, data + card + [CommitOperationDelete(path_in_repo=p) for p in stale],
                                   repo_type="dataset", revision=revision,
                                   commit_message=message + (f" ({len(stale)} stale file(s) deleted)" if stale else ""))
        result.url = commit.commit_url
    except Exception as exc:  # a refusal or a network failure becomes one line; anything else is a bug, re-raised
        failure = hub_failure(exc, step, api.endpoint, repo_id)
        if failure is None:
            raise
        raise UploadError(f"{failure}{resume}") from None
    return result


def _remote_files(api, repo_id: str, revision: str | None) -> dict[str, tuple[str | None, str]]:
    """path -> (LFS sha256 or None, git blob id) of every file at the revision."""
    from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError
    from huggingface_hub.hf_api import RepoFile

    try:
        return {item.path: (item.lfs.sha256 if item.lfs else None, item.blob_id)
                for item in api.list_repo_tree(repo_id, repo_type="dataset", revision=revision, recursive=True)
                if isinstance(item, RepoFile)}
    except HfHubHTTPError as exc:
        # the repository exists (it was just created or found): a revision with no commit yet has no tree
        if isinstance(exc, RepositoryNotFoundError) or exc.response is None or exc.response.status_code != 404:
            raise
        return {}


def _git_blob_id(path: Path) -> str:
    """`git hash-object`: the id the Hub lists for a regular (non-LFS) file."""
    digest = hashlib.sha1(f"blob {path.stat().st_size}\0".encode())
    with open(path, "rb") as fh:
        while chunk := fh.read(2**20):
            digest.update(chunk)
    return digest.hexdigest()


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
    if unreachable(exc):
        return UploadError(_one_line(f"{step} failed: could not reach {endpoint} ({type(exc).__name__}: {exc}); "
                                     "check HF_ENDPOINT and the network (proxy, firewall)"))
    if _raised_in_huggingface_hub(exc):  # an answer the client could not read: the endpoint's doing, not a bug here
        return UploadError(_one_line(f"{step} failed: {endpoint} gave an answer huggingface_hub cannot read "
                                     f"({type(exc).__name__}: {exc}); check that HF_ENDPOINT is a Hugging Face Hub"))
    return None


def _raised_in_huggingface_hub(exc: BaseException) -> bool:
    import huggingface_hub

    frames = traceback.extract_tb(exc.__traceback__)
    package = str(Path(huggingface_hub.__file__).parent)
    return bool(frames) and frames[-1].filename.startswith(package)


def _one_line(text: str) -> str:
    return scrub(" ".join(text.split()))
