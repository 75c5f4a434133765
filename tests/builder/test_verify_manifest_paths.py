"""`medbanana verify` on a built dataset folder whose SHA256SUMS names a file through `..` (issue 26, item 7).

`alias/../evil.bin`, with `alias` a symlink to a folder two levels down, resolves to `data/evil.bin` (hashed, and it
matches) while its entry would read as the top-level `evil.bin`: an unhashed file counted as listed. Such a line is
refused, named, before anything is hashed.
"""

import hashlib
import os
import shutil
from pathlib import Path

import pytest

from medbanana.generation.dataset import manifest
from medbanana.generation.dataset.manifest import MANIFEST
from medbanana.builder.synthetic_run import make_synthetic_run
from medbanana.cli import main


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("verify-paths")
    make_synthetic_run(root / "run", flavor="ours", tasks_per_folder=3, datasets=("mimic_ours_cxr",), seed=5)
    assert main(["build", str(root / "run"), "--out", str(root / "ds"), "-q"]) == 0
    return root / "ds"


@pytest.fixture
def dataset(built, tmp_path):
    return Path(shutil.copytree(built, tmp_path / "ds", symlinks=True))


def test_a_dotdot_line_through_a_symlinked_folder_is_refused_before_hashing(dataset, monkeypatch, capsys):
    assert main(["verify", str(dataset)]) == 0
    capsys.readouterr()
    (dataset / "data" / "inner").mkdir(parents=True)
    (dataset / "data" / "evil.bin").write_bytes(b"what the manifest vouches for")
    (dataset / "evil.bin").write_bytes(b"what a user of the folder would load")
    (dataset / "alias").symlink_to("data/inner", target_is_directory=True)
    digest = hashlib.sha256(b"what the manifest vouches for").hexdigest()
    listed = (dataset / MANIFEST).read_text()
    line_no = listed.count("\n") + 1
    (dataset / MANIFEST).write_text(f"{listed}{digest}  data/evil.bin\n{digest}  alias/../evil.bin\n")
    assert os.path.realpath(dataset / "alias" / ".." / "evil.bin") == str((dataset / "data" / "evil.bin").resolve())
    hashed, real = [], manifest.sha256_file
    monkeypatch.setattr(manifest, "sha256_file", lambda p: hashed.append(p) or real(p))
    assert main(["verify", str(dataset)]) == 1
    err = capsys.readouterr().err
    bad = [line for line in err.splitlines() if "alias/../evil.bin" in line]
    assert len(bad) == 1 and f"{MANIFEST}:{line_no + 1}:" in bad[0] and "'..'" in bad[0], err
    assert "nothing was checked" in err and f"{MANIFEST}:{line_no}:" not in err  # the plain line is fine
    assert hashed == []


def test_hidden_files_and_the_manifest_itself_need_no_line(dataset, capsys):
    """What docs/security.md says verify ignores: SHA256SUMS itself, hidden files and folders, what is only reached
    through a symlinked folder; any other file, a second SHA256SUMS in a subfolder included, must be listed."""
    (dataset / ".cache").mkdir(exist_ok=True)
    (dataset / ".cache" / "x").write_bytes(b"hub clone state")
    (dataset / ".hidden").write_bytes(b"dotfile")
    (dataset / "link").symlink_to("sft", target_is_directory=True)  # not descended into
    manifest.write_manifest(dataset)
    assert main(["verify", str(dataset)]) == 0
    written = (dataset / MANIFEST).read_text()
    assert ".cache" not in written and ".hidden" not in written and "link/" not in written and "sft/" in written
    (dataset / "sft" / MANIFEST).write_bytes(b"not the manifest")
    assert main(["verify", str(dataset)]) == 1
    assert f"1 not in the manifest: sft/{MANIFEST}" in capsys.readouterr().out
