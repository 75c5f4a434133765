"""The package installs as `medbanana` only, as a wheel too, and README / CI agree on the commands."""

import os
import re
import subprocess
import sys
import zipfile

import pytest
from paths import ROOT



def block_after(text: str, heading: str) -> list[str]:
    """The command lines of the first shell block after `heading` (a Markdown heading of README.md)."""
    section = text.split(f"\n{heading}\n", 1)[1]
    block = re.search(r"```(?:bash|sh)\n(.*?)```", section, re.S)[1]
    return [line.strip() for line in block.splitlines() if line.strip() and not line.startswith("#")]


def test_readme_has_the_users_setup_and_the_contributors_tests_apart_and_ci_runs_the_second():
    """Two blocks, so that a copy button copies one: the user's set-up (install, then the demo) first in the README,
    the contributors' test command under "## Tests"; .ci/run ends with the latter, word for word."""
    text = (ROOT / "README.md").read_text()
    (setup,) = re.search(r"```(?:bash|sh)\n(.*?)```", text, re.S)[1].strip().splitlines()
    (tests,) = block_after(text, "## Tests")
    assert "pip install ." in setup and "medbanana demo" in setup and "pytest" not in setup
    assert "pytest" in tests and "[dev" in tests and "medbanana demo" not in tests
    assert "for contributors" in text.split("\n## Tests\n", 1)[1].split("```")[0].lower()
    ci_lines = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line.strip()]
    assert ci_lines[-1].strip() == tests


@pytest.mark.slow
def test_wheel_installs_under_the_medbanana_namespace_only(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path / "dist"), str(ROOT)],
                   check=True, cwd=tmp_path)
    (wheel,) = (tmp_path / "dist").glob("medbanana-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names if not n.startswith("medbanana-")}
    assert top == {"medbanana"}, top
    for needed in ("medbanana/generation/taxonomy.json", "medbanana/generation/prices.json", "medbanana/dataset_card.md",
                   "medbanana/cli.py",
                   "medbanana/medbanana_50k.py", "medbanana/demo.py", "medbanana/export.py", "medbanana/builder/__init__.py", "medbanana/loaders/__init__.py",
                   "medbanana/review/zoom.js"):
        assert needed in names, needed
    assert not any(n.startswith("medbanana/tests/") or n.startswith("medbanana/bench/") for n in names)
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
                   check=True)
    env = {**os.environ, "PYTHONPATH": str(target)}
    code = "import medbanana, medbanana.cli as c; print(medbanana.__file__); c.main(['taxonomy'])"
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True,
                         check=True).stdout
    assert out.splitlines()[0].startswith(str(target))
    assert "23 labels, 20 edit targets" in out
