"""The linters CI runs, as tests (so that README's one test command runs them): `ruff check` with the rule set in
pyproject.toml over the whole repository, and mypy over the modules whose types are kept exact."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
from paths import ROOT

# modules whose annotations are complete and checked; add a module here once mypy passes on it
TYPED_MODULES = (
    "generation.records", "generation.outcomes", "generation.taxonomy", "generation.extras", "generation.secrets",
    "generation.files",
    "generation.loop", "generation.rundir.layout", "generation.rundir.lock", "generation.backends.base",
    "generation.dataset.features", "generation.tables",
)


def test_ruff_finds_nothing():
    ruff = shutil.which("ruff", path=os.path.dirname(sys.executable)) or shutil.which("ruff")
    if ruff is None:
        pytest.fail("ruff is not installed: pip install -e '.[dev]'")
    result = subprocess.run([ruff, "check", "--no-cache", "."], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_typed_modules_pass_mypy(tmp_path):
    pytest.importorskip("mypy", reason="mypy is in the dev extra")
    # the repository root is the `medbanana` package (pyproject's package-dir), which mypy finds only by that name
    (tmp_path / "medbanana").symlink_to(ROOT, target_is_directory=True)
    args = [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"), "--no-incremental"]
    for module in TYPED_MODULES:
        args += ["-p", f"medbanana.{module}"]
    result = subprocess.run(args, cwd=tmp_path, env={**os.environ, "MYPYPATH": str(tmp_path)}, capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stdout + result.stderr
