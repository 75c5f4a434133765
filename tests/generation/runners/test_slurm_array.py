"""The Slurm job-array recipe of docs/scaling.md (generation/runners/slurm_recipe.py), run as Slurm would run it.

A stand-in `sbatch` on PATH reads the script's `#SBATCH --array=0-K` and starts one process per array task with
SLURM_ARRAY_TASK_ID set, all at once, and runs a job given `--dependency=afterok:ID` only when every task of ID
succeeded. The submission lines run as written (only the two example paths are replaced) against the fake Gemini
server, and the merged run must equal a single run of the same options task by task.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from fake_runs import mimic_sources, use_fake_gemini
from medbanana.cli import main
from medbanana.generation.rundir import layout
from medbanana.generation.rundir.store import read_journal
from medbanana.generation.runners.slurm_recipe import MERGE_SCRIPT, SHARDS_SCRIPT, SUBMIT
from medbanana.generation.testing.fake_gemini import FakeGemini
from paths import ROOT

KEY = "slurm-test-key-5e2a"

# sbatch [--parsable] [--dependency=afterok:ID] SCRIPT: runs the job now, records its outcome, prints its id
FAKE_SBATCH = """\
import os, re, subprocess, sys
from pathlib import Path

*options, script = sys.argv[1:]
state = Path(os.environ["FAKE_SLURM_STATE"])
state.mkdir(exist_ok=True)
for option in options:
    if option.startswith("--dependency="):
        kind, _, job = option.partition("=")[2].partition(":")
        assert kind == "afterok", option
        if (state / job).read_text() != "ok":
            sys.exit(f"sbatch: job {job} failed: dependency never satisfied")
text = Path(script).read_text()
job = str(len(list(state.iterdir())) + 1000)
array = re.search(r"^#SBATCH --array=(\\d+)-(\\d+)$", text, re.M)
ids = range(int(array[1]), int(array[2]) + 1) if array else [None]
logs = [open(f"slurm-{job}" + (f"_{i}" if i is not None else "") + ".out", "w") for i in ids]  # as Slurm names them
runs = [subprocess.Popen(["bash", script], stdout=log, stderr=subprocess.STDOUT,
                         env={**os.environ, "SLURM_JOB_ID": job,
                              **({"SLURM_ARRAY_JOB_ID": job, "SLURM_ARRAY_TASK_ID": str(i)} if i is not None else {})})
        for i, log in zip(ids, logs)]
codes = [run.wait() for run in runs]
(state / job).write_text("ok" if not any(codes) else f"failed {codes}")
print(job if "--parsable" in options else f"Submitted batch job {job}")
"""


def _tasks(run_dir: Path) -> dict[str, tuple]:
    found = {}
    for _, _, folder in layout.find_output_dirs(run_dir):
        for record in json.loads((folder / layout.ALL_CONVERSATIONS).read_text()).values():
            found[record["uid"]] = (record["status"], record.get("success_round"),
                                    [(r["round"], r["instruction"], r.get("verification"), r.get("image"))
                                     for r in record["rounds"]])
    return found


@pytest.mark.slow
def test_the_array_recipe_run_as_slurm_would_merges_into_the_single_run(tmp_path, monkeypatch):
    sources = mimic_sources(tmp_path / "sources", "MIMIC_slurm", disease="Pleural_Effusion", per_class=1)
    runs, bin_dir, jobs = tmp_path / "runs", tmp_path / "bin", tmp_path / "jobs"
    bin_dir.mkdir()
    sbatch = bin_dir / "sbatch"
    sbatch.write_text(f"#!{sys.executable}\n{FAKE_SBATCH}")
    sbatch.chmod(0o755)
    (jobs / "medbanana-shards.sbatch").parent.mkdir()
    (jobs / "medbanana-shards.sbatch").write_text(SHARDS_SCRIPT)
    (jobs / "medbanana-merge.sbatch").write_text(MERGE_SCRIPT)
    submit = SUBMIT.replace("/shared/sources", str(sources)).replace("/shared/runs", str(runs))
    assert submit.count(str(tmp_path)) == 2  # the example paths were there to replace

    with FakeGemini(engine="echo") as fake:
        env = {**os.environ, "GEMINI_API_KEY": KEY, "GOOGLE_GEMINI_BASE_URL": fake.base_url,
               "PATH": f"{bin_dir}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
               "FAKE_SLURM_STATE": str(tmp_path / "slurm-state")}
        env.pop("SLURM_ARRAY_TASK_ID", None)
        done = subprocess.run(["bash", "-euc", submit], cwd=jobs, env=env, capture_output=True, text=True,
                              timeout=300)
        logs = "".join(p.read_text() for p in sorted(jobs.glob("slurm-*.out")))
        assert done.returncode == 0, done.stdout + done.stderr + logs
        use_fake_gemini(monkeypatch, fake, KEY)
        assert main(["generate", "--sources", str(sources), "--out", str(tmp_path / "single"), "--backend", "gemini", "--seed", "0",
                     "-q"]) == 0

    count = int(SHARDS_SCRIPT.split("\nN=")[1].split()[0])
    assert len(list(jobs.glob("slurm-*_*.out"))) == count  # one process per array task
    assert sorted(p.name for p in runs.iterdir()) == sorted([f"shard-{i}-of-{count}" for i in range(count)]
                                                            + ["merged"])
    for i in range(count):  # each array task ran its own shard
        config = json.loads((runs / f"shard-{i}-of-{count}" / layout.RUN_CONFIG).read_text())
        assert config["selection"]["shard"] == [i, count]
    single = _tasks(tmp_path / "single")
    assert len(single) == 12 and _tasks(runs / "merged") == single
    finished = [e["uid"] for e in read_journal(runs / "merged" / layout.JOURNAL) if e["type"] == "task"]
    assert sorted(finished) == sorted(single)


def test_the_docs_show_the_tested_recipe():
    page = (ROOT / "docs" / "scaling.md").read_text()
    for text in (SHARDS_SCRIPT, MERGE_SCRIPT, SUBMIT):
        assert text in page, f"docs/scaling.md lacks, verbatim, the recipe text that starts {text.splitlines()[0]!r}"
