"""The reports of `judge-agreement` and of eval's probes replace their files by a rename: a hard link or a symbolic
link left in the output folder (to a file outside it) is never written through, and eval's own report is never read
through a link."""

import json
import os

import pytest

from test_evaluation_agreement import four_edits  # noqa: F401  (a fixture)
from test_evaluation_separability import samples_with_format_confound

from medbanana.cli import main


def plant_links(out, outside, names):
    """Each name in `out` a hard link (even) or a symbolic link (odd) to its own file in `outside`."""
    out.mkdir()
    outside.mkdir()
    targets = {}
    for i, name in enumerate(names):
        target = outside / f"precious-{i}"
        target.write_text(f"not medbanana's {i}\n")
        (os.link if i % 2 == 0 else os.symlink)(target, out / name)
        targets[target] = target.read_text()
    return targets


def test_judge_agreement_writes_no_file_through_a_link(four_edits, tmp_path):  # noqa: F811
    out = tmp_path / "out"
    targets = plant_links(out, tmp_path / "outside", ["agreement.json", "report.md", "verdicts.jsonl"])
    assert main(["judge-agreement", str(four_edits), "--out", str(out), "--repeats", "2", "--judge", "simulator"]) == 0
    assert {path: path.read_text() for path in targets} == targets
    assert json.loads((out / "agreement.json").read_text())["edits"] == 4
    assert not (out / "report.md").is_symlink() and (out / "report.md").stat().st_nlink == 1


@pytest.mark.slow
def test_eval_probe_outputs_are_written_by_rename(tmp_path):
    folder = tmp_path / "in"
    folder.mkdir()
    rows = [{"id": s.id, "source": s.source.name, "edited": s.edited.name, "instruction": "Add a pleural effusion.",
             "disease": "Pleural Effusion", "direction": "add", "accepted": "true"}
            for s in samples_with_format_confound(folder, n=12)]
    (folder / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    names = ["separability.json", "probe_samples.csv", "separability.png", "separability.csv"]
    targets = plant_links(out, tmp_path / "outside", names)
    assert main(["eval", str(folder), "--out", str(out), "--judge", "none", "--no-lpips", "-q", "--separability",
                 "--probe-size", "64", "--probe-detail", "128", "--probe-workers", "1"]) == 0
    assert {path: path.read_text() for path in targets} == targets
    for name in names:
        written = out / name
        assert not written.is_symlink() and written.stat().st_nlink == 1 and written.stat().st_size > 0
    assert "## Separability (real vs edited)" in (out / "report.md").read_text()
