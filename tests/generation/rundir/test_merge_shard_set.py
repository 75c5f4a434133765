"""`medbanana merge` sees the shard set: the runs of a `--shard i/N` split must all be there, unless --partial,
which the merged run records and the card of a dataset built from it says."""

from __future__ import annotations

import json

import pytest

from medbanana.cli import main
from medbanana.generation.rundir import layout


@pytest.fixture
def shards(tiny_sources, tmp_path, monkeypatch):
    """Three shards of one run, made by `medbanana generate --shard i/3` (the offline simulator, 5 tasks)."""
    for name in ("GEMINI_API_KEY", "GOOGLE_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    made = []
    for i in range(3):
        made.append(tmp_path / f"shard{i}")
        assert main(["generate", "--sources", str(tiny_sources), "--out", str(made[-1]), "--shard", f"{i}/3",
                     "--diseases", "Pneumothorax", "Glaucoma", "--max-rounds", "1", "-q"]) in (0, 3)
    return made


def _config(run_dir):
    return json.loads((run_dir / layout.RUN_CONFIG).read_text())


@pytest.mark.slow
def test_an_incomplete_shard_set_is_refused_unless_partial_which_the_card_then_says(shards, tmp_path, capsys):
    out = tmp_path / "merged"
    capsys.readouterr()
    assert main(["merge", str(shards[0]), str(shards[2]), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "incomplete shard set: 1 of 3 shards missing (1/3)" in err and "--partial" in err
    assert err.count("\n") == 1 and not out.exists()  # refused before anything is written

    assert main(["merge", str(shards[0]), str(shards[2]), "--out", str(out), "--partial"]) == 0
    said = capsys.readouterr().out
    assert "partial: " in said and "holds 2 of 3 shards" in said
    config = _config(out)
    assert config["partial"] is True and config["shards"] == {"of": 3, "merged": [0, 2]}

    dataset = tmp_path / "dataset"
    assert main(["build", str(out), "--out", str(dataset), "-q"]) == 0
    assert "run merged holds 2 of 3 shards (`merge --partial`)" in capsys.readouterr().err
    card = (dataset / "README.md").read_text(encoding="utf-8")
    assert "**Partial:**" in card and "merged holds shards 0, 2 of 3" in card
    assert json.loads((dataset / "medbanana-build.json").read_text())["partial_runs"] == {
        "merged": {"of": 3, "merged": [0, 2]}}

    # the missing shard merged in later completes the run (what --out holds counts): no --partial needed
    assert main(["merge", str(shards[1]), "--out", str(out)]) == 0
    assert "partial" not in capsys.readouterr().out
    config = _config(out)
    assert config["partial"] is False and config["shards"] == {"of": 3, "merged": [0, 1, 2]}
    assert main(["build", str(out), "--out", str(dataset), "-q"]) == 0
    assert "Partial" not in (dataset / "README.md").read_text(encoding="utf-8")
    assert "partial" not in capsys.readouterr().err


@pytest.mark.slow
def test_the_whole_set_merges_and_shards_of_two_splits_are_refused(shards, tiny_sources, tmp_path, capsys):
    assert main(["merge", *map(str, shards), "--out", str(tmp_path / "all")]) == 0
    assert _config(tmp_path / "all")["partial"] is False
    other = tmp_path / "other"
    assert main(["generate", "--sources", str(tiny_sources), "--out", str(other), "--shard", "1/2",
                 "--diseases", "Pneumothorax", "Glaucoma", "--max-rounds", "1", "-q"]) in (0, 3)
    capsys.readouterr()
    assert main(["merge", str(shards[0]), str(other), "--out", str(tmp_path / "mixed"), "--partial"]) == 2
    assert "shards of different splits (of 2 and of 3)" in capsys.readouterr().err
    assert not (tmp_path / "mixed").exists()
