"""The original scripts' JSON files of a run: rewritten only for the folder pairs with a task finished since the last
time, byte for byte what a full rebuild writes, and never so often that rewriting them takes most of a run."""

from __future__ import annotations

import json
import os
from pathlib import Path

from scripted import ScriptedEditor, ScriptedJudge, ScriptedWriter
from medbanana.generation.outcomes import ApiFailure, TaskOutcome, TaskStatus
from medbanana.generation.records import Task
from medbanana.generation.rundir import layout, layout_files, store as store_module
from medbanana.generation.rundir.store import MATERIALIZE_SHARE, RunStore
from medbanana.generation.runners.local import run
from medbanana.generation.runners.session import RunOptions
from medbanana.generation.sources.scan import scan_sources


def _files(out: Path) -> dict[str, tuple[int, bytes]]:
    """Every JSON file of the layout: relative path -> (inode, bytes); an atomic rewrite gives a new inode."""
    found = {}
    for dataset, direction, accepted in layout.find_output_dirs(out):
        for folder in (accepted, layout.failed_dir(out, dataset, direction)):
            for path in folder.glob("*.json"):
                found[path.relative_to(out).as_posix()] = (os.stat(path).st_ino, path.read_bytes())
    return found


def _reopen(out: Path) -> RunStore:
    config = json.loads((out / layout.RUN_CONFIG).read_text())
    return RunStore(out, {k: config.get(k) for k in ("max_rounds", "accept", "seed", "backends", "geometry")}).open()


def _run_all_but_one_task_per_pair(sources: Path, out: Path, judge: ScriptedJudge) -> dict[tuple[str, str], Task]:
    """A run of every task but one of each folder pair; those left out, by pair."""
    tasks, left = scan_sources(sources), {}
    for task in tasks:
        left.setdefault((task.dataset, task.direction), task)
    run([t for t in tasks if t not in left.values()], out, ScriptedWriter(), ScriptedEditor(), judge,
        RunOptions(quiet=True, max_rounds=3))
    return left


def _finish(store: RunStore, task: Task) -> str:
    """The task finished as a writer call that failed would end it; its key."""
    store.finish_task(TaskOutcome(task, TaskStatus.API_FAILED, [], ApiFailure("generate_prompt", 1, "refused")))
    return task.key


def test_only_the_changed_folder_pair_is_rewritten_and_it_matches_a_full_rebuild(tiny_sources, tmp_path):
    out = tmp_path / "run"
    left = _run_all_but_one_task_per_pair(tiny_sources, out, ScriptedJudge(lambda t: 2))
    assert len(left) == 4  # two datasets, both directions
    store = _reopen(out)
    store.materialize()  # the first time after opening: every pair
    before = _files(out)
    changed = ("MIMIC_tiny", "add")
    key = _finish(store, left[changed])
    store.materialize()
    after = _files(out)
    changed_folders = (layout.output_dir(out, *changed).name, layout.failed_dir(out, *changed).name)
    for rel, (inode, data) in after.items():
        if rel.split("/")[0] in changed_folders:
            assert inode != before[rel][0]
        else:  # untouched: the same file, not the same bytes written again
            assert (inode, data) == before[rel], rel
    conversations = json.loads(after[f"{changed_folders[0]}/{layout.ALL_CONVERSATIONS}"][1])
    assert key in conversations
    store.close()

    full = _reopen(out)  # a new store writes every pair: the same bytes as the store that wrote only one
    full.materialize()
    assert {rel: data for rel, (_, data) in _files(out).items()} == {rel: data for rel, (_, data) in after.items()}
    full.close()


def test_a_slow_materialisation_waits_long_enough_to_take_at_most_its_share(tiny_sources, tmp_path, monkeypatch):
    out = tmp_path / "run"
    left = _run_all_but_one_task_per_pair(tiny_sources, out, ScriptedJudge(lambda t: 1))
    clock = [1000.0]
    monkeypatch.setattr(store_module.time, "monotonic", lambda: clock[0])
    writes = []
    write = layout_files.write_folder_pair

    def slow_write(*args):  # as a pair of 50,000 tasks would be: 2 s each
        writes.append(args[1:3])
        clock[0] += 2.0
        write(*args)

    monkeypatch.setattr(layout_files, "write_folder_pair", slow_write)
    store = _reopen(out)
    store.materialize()
    took = 2.0 * len(writes)
    key = _finish(store, left["ODIR_tiny", "add"])
    writes.clear()
    clock[0] += 30.0
    store.maybe_materialize(30.0)  # 30 s have passed, but the last one took `took` s: it waits longer
    assert writes == []
    clock[0] += took / MATERIALIZE_SHARE - 30.0
    store.maybe_materialize(30.0)
    assert writes == [("ODIR_tiny", "add")]  # the one pair changed since
    assert key in json.loads((layout.output_dir(out, "ODIR_tiny", "add")
                                        / layout.ALL_CONVERSATIONS).read_text())
    _finish(store, left["MIMIC_tiny", "remove"])
    clock[0] += 2.0 / MATERIALIZE_SHARE - 1  # that one wrote one pair in 2 s: it waits 40 s, not took / share
    store.maybe_materialize(30.0)
    assert writes[-1] == ("ODIR_tiny", "add")
    clock[0] += 1
    store.maybe_materialize(30.0)
    assert writes[-1] == ("MIMIC_tiny", "remove")
    store.close()
