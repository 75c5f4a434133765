"""Values `build` reads as their column's type though they are not written as one are counted and named, and an OS
error the build meets names its path (issue 37, item 8).

A judge's `score` of "high" becomes null in the parquet, like a boolean of "maybe" becomes a guess: each is counted
per field in `stats.coerced` of medbanana-build.json, named on stderr in one line per field and in the card. Runs
are real trees (the builder's synthetic run of our format), built by the real CLI.
"""

import json
import os

import pyarrow.parquet as pq
import pytest

from test_build_containment import EDIT, base, build, conversations, run, write_conversations  # noqa: F401


def _scores(out) -> list:
    return [score for path in sorted((out / "judge").glob("*.parquet"))
            for score in pq.read_table(path, columns=["score"]).column("score").to_pylist()]


@pytest.mark.slow
def test_a_score_that_is_no_number_is_read_as_null_or_its_number_counted_and_named(run, tmp_path, capsys):
    code, err, out = build(tmp_path, capsys, run, "--configs", "judge")
    assert code == 0 and "'score'" not in err, err
    assert "score" not in json.loads((out / "medbanana-build.json").read_text())["stats"]["coerced"]
    nulls = _scores(out).count(None)

    data = conversations(run)
    judged = [r["verification"] for e in data.values() for r in e["rounds"] if r.get("verification")]
    judged[0]["score"], judged[1]["score"], judged[2]["score"] = "high", "0.75", True
    judged[3]["score"] = 1  # an integer is a number: read as 1.0, not counted
    write_conversations(run, data)
    code, err, out = build(tmp_path, capsys, run, "--configs", "judge", out="coerced")
    assert code == 0, err
    coerced = json.loads((out / "medbanana-build.json").read_text())["stats"]["coerced"]
    assert coerced == {"score": {"count": 3, "examples": {"'0.75'": 0.75, "'high'": None, "True": 1.0}}}
    lines = [line for line in err.splitlines() if "'score'" in line]
    assert len(lines) == 1 and "3 judge value(s) of 'score' were not numbers" in lines[0]
    assert "'high' as null" in lines[0] and "'0.75' as 0.75" in lines[0]
    assert "Judge scores that were no number were read as the number they spell, or null: 3 `score`" in \
        (out / "README.md").read_text()
    scores = _scores(out)
    assert scores.count(None) == nulls + 1 and 0.75 in scores  # "high" is null, "0.75" its number


def test_an_os_error_the_cli_meets_names_its_path_in_one_line(run, tmp_path, capsys):
    """A folder where a file goes, a file where a folder goes: one line naming the path, never `[Errno 21] ...: 5`."""
    entry = next(e for e in conversations(run).values() if e["rounds"] and e["rounds"][0].get("image"))
    image = run / entry["rounds"][0]["image"]
    image.unlink()
    image.mkdir()  # a folder named like an image: as good as missing, named in the warning
    code, err, out = build(tmp_path, capsys, run, "--configs", "judge")
    assert code == 0, err
    assert "[Errno" not in err and f"{EDIT}" in err and "not found" in err

    (tmp_path / "a-file").write_text("not a folder")
    code, err, _ = build(tmp_path, capsys, run, "--configs", "judge", out="a-file/dataset")
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert "[Errno" in lines[0] and str(tmp_path / "a-file") in lines[0]
    assert os.path.isfile(tmp_path / "a-file")
