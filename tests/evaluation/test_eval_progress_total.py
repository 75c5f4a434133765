"""`medbanana eval`'s progress bar knows its total where the input can be counted cheaply: a samples file (its
entries), a built dataset (its parquet footers' row counts), a run (its records' attempts with an image). Each
total is checked against what the command then scored, in a real process, as a user sees the bar on stderr."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
from test_evaluation_eval import chest_like, write_manifest

BAR_END = re.compile(r"\| (\d+)/(\d+) \[")  # tqdm's "| 3/3 [": without a total it shows "3sample ["


def eval_bar(argv: list, out) -> tuple[str, str, int]:
    """(the bar's last count, its total, samples scored) of `medbanana eval ARGV --out OUT`."""
    done = subprocess.run([sys.executable, "-m", "medbanana", "eval", *map(str, argv), "--out", str(out),
                           "--judge", "none", "--no-lpips"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    ends = BAR_END.findall(done.stderr)
    assert ends, done.stderr
    scored = len((out / "samples.jsonl").read_text().splitlines())
    return *ends[-1], scored


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["jsonl", "csv"])
def test_a_samples_file_gives_the_bar_its_entries(tmp_path, fmt):
    specs = [{"id": f"s{i}", "source": chest_like(seed=i), "edited": chest_like(seed=i + 10)} for i in range(3)]
    folder = write_manifest(tmp_path / "in", specs, fmt)
    count, total, scored = eval_bar([folder], tmp_path / "out")
    assert (count, total, scored) == ("3", "3", 3)
    assert eval_bar([folder, "--limit", "2"], tmp_path / "limited")[:2] == ("2", "2")


@pytest.mark.slow
def test_a_built_dataset_and_a_run_give_the_bar_their_counts(demo_run_root, tmp_path):
    demo = demo_run_root / "demo-run"
    count, total, scored = eval_bar([demo / "dataset"], tmp_path / "dataset")
    assert count == total == str(scored) and scored > 0
    count, total, scored = eval_bar([demo / "run", "--source-images", demo / "sources", "--all-attempts"],
                                    tmp_path / "run")
    assert count == total == str(scored) and scored > 0
    records = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert len({r["id"] for r in records}) == scored  # every attempt with an image, once
    # resumed: the samples scored before count too, so the bar still ends at its total
    assert eval_bar([demo / "run", "--source-images", demo / "sources", "--all-attempts"],
                    tmp_path / "run")[:2] == (total, total)


def test_a_samples_file_given_itself_gives_the_bar_its_entries(tmp_path):
    specs = [{"id": "only", "source": chest_like(), "edited": chest_like(seed=3)}]
    folder = write_manifest(tmp_path / "in", specs)
    assert eval_bar([folder / "samples.jsonl"], tmp_path / "out") == ("1", "1", 1)
