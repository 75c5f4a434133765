"""`medbanana build`: run directories -> a Hugging Face dataset folder (parquet configs, README.md, SHA256SUMS).

Work is split into `num_proc` partitions of units (output folders / records files, or blocks of their tasks when
there are fewer units than workers); each worker reads its own JSON and streams its own shards, so no metadata
crosses processes.
Each task's images are read once (by reader threads, a few tasks ahead) and written into every config that needs
them; closed shards are hashed for SHA256SUMS in a thread while writing goes on. The folder is built next to
`--out` and moved into place only when complete: a failed build leaves the previous one untouched. What may be
replaced, and the locks held meanwhile (the runs read shared, `--out` exclusive), are in `output.py`.

Nothing from outside the runs (or `--source-images`) is read, and only JPEG/PNG images are embedded (`safety`):
a refused input stops the build (`unsafe="error"`) or leaves its task out and is listed in the statistics
(`unsafe="skip"`), never embedded and never dropped silently.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import queue
import shutil
import warnings
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tqdm.auto import tqdm

from ..generation.acceptance import rule_option
from ..generation.dataset.configs import CONFIG_NAMES, REVIEW_CONFIG
from ..generation.dataset.features import CONFIG_FEATURES
from ..generation.dataset.folder import BUILD_INFO, CARD, FIGURE
from ..generation.dataset.manifest import write_manifest
from ..generation.dataset.output import BuildError, BuildLocks, move_into_place, remove_stale_staging, run_folder
from ..generation.interrupts import children_ignore_sigint
from ..generation.records import DEFAULT_MAX_ROUNDS
from ..generation.rundir.confined import POLICIES, Refused
from ..generation.rundir.runs import (discover_units, recorded_destinations, recorded_max_rounds, recorded_partial,
                                      recorded_signing, task_keys, unit_size)
from ..generation.rundir.source_index import SourceIndex
from ..generation.rundir.task_records import Unit
from .acceptance import acceptance_note, expert_approval, policy_labels, recorded_rules, review_labels
from .card import build_info, coerced_note, md_escape, partial_note, refused_note, render_card
from .paper import EVAL_EXTRA, require_matplotlib, save_figure3
from .parquet import ConfigSchema, finalize_shards
from .partition import PartitionSpec, build_partition, error_line, partition_worker
from .reviews import open_reviews, reviewed_uids, write_reviews
from .rows import IMAGE_CONFIGS
from .stats import BuildStats



def parse_size(text: str | int) -> int:
    """'500MB' -> 500_000_000 (datasets' convention: MB = 10**6, MiB = 2**20)."""
    from datasets.utils.py_utils import convert_file_size_to_int

    try:
        size = convert_file_size_to_int(text)
    except ValueError:
        raise BuildError(f"not a size: {text!r} (use e.g. 500MB, 1GB or a number of bytes)") from None
    if size <= 0:
        raise BuildError(f"the largest parquet file size (--max-file-size) must be positive, not {text!r}")
    return size


def build(run_dirs: Sequence[Path], out: Path, *, configs: Sequence[str] = CONFIG_NAMES, test_fraction: float = 0.0,
          max_shard_size: str | int = "500MB", num_proc: int = 1, source_images: Path | None = None,
          quiet: bool = False, unsafe: str = "error", reviews: Sequence[Path] = (),
          review_reasons: str = "keep", accept: str | None = None) -> dict:
    """Build the dataset folder `out` from run directories; returns what `medbanana-build.json` holds.

    `unsafe`: what a refused input does (a path leading outside its root, a file that is not an image, a
    malformed entry): "error" stops the build with a BuildError naming it; "skip" leaves its task out and lists
    it under `stats.refused`. `reviews`: `medbanana review` folders whose answers become `human_review` (their free-text
    reasons left out with review_reasons="drop"). `accept`: a rule or a POLICY.json (`medbanana calibrate`) that
    re-decides every task from its recorded verdicts (builder/acceptance.py). Raises
    BuildError, before anything is written, for an `out` holding anything a build does not write or an input run
    (or inside one), and generation.rundir.lock.LockHeld when another process writes an input run or builds `out`."""
    configs = tuple(configs)
    unknown = [c for c in configs if c not in CONFIG_NAMES]
    if unknown or not configs:
        raise BuildError(f"unknown config(s) {', '.join(unknown) or '(none given)'}; choose from "
                         f"{', '.join(CONFIG_NAMES)} (--configs)")
    if not 0 <= test_fraction < 1:
        raise BuildError(f"--test-fraction must be in [0, 1), not {test_fraction}")
    if num_proc < 1:
        raise BuildError("--workers (num_proc) must be at least 1")
    if unsafe not in POLICIES:
        raise BuildError(f"--unsafe must be one of {', '.join(POLICIES)}, not {unsafe!r}")
    max_shard_bytes = parse_size(max_shard_size)
    out, inputs = Path(out).resolve(), [Path(p) for p in run_dirs]
    if source_images is not None and not Path(source_images).is_dir():
        raise BuildError(f"--source-images: folder not found: {source_images}")
    if source_images is not None and not IMAGE_CONFIGS & set(configs):
        raise BuildError(f"--source-images: none of the configs built ({', '.join(configs)}) has a source_image "
                         "column; add one of " + ", ".join(sorted(IMAGE_CONFIGS)))
    review_stores = open_reviews(reviews)
    rule, policy = _acceptance(accept)
    labels = review_labels(review_stores) or (policy_labels(policy) if policy else {})
    with BuildLocks(out) as locks:  # refusals come before anything is written (output.py)
        locks.read(map(run_folder, inputs))
        found_refused: list[Refused] = []
        units = discover_all(inputs, found_refused.append if unsafe == "skip" else None)
        if rule is not None and any(unit.kind == "images" for unit in units):
            raise BuildError(f"--accept re-decides the judge's recorded verdicts; "
                             f"{next(u.label for u in units if u.kind == 'images')} is an image-only release with none")
        locks.read(unit.run_dir for unit in units)  # a {D}-edit folder or records file given: its run
        locks.write()
        remove_stale_staging(out)  # a killed build's: under the write lock, no other build of `out` is running
        staging = out.with_name(f".{out.name}.building-{os.getpid()}")
        staging.mkdir(parents=True)
        try:
            sources_root = Path(source_images).resolve() if source_images else None
            schemas = {config: ConfigSchema.of(CONFIG_FEATURES[config]) for config in configs}
            review_uids = reviewed_uids(review_stores)
            specs = [PartitionSpec(p, items, staging, configs, test_fraction, max_shard_bytes, schemas, sources_root,
                                   unsafe, review_uids, rule, frozenset(labels))
                     for p, items in enumerate(plan_partitions(units, num_proc))]
            stats, digests = _run_partitions(specs, quiet)
            sources = _check_sources(stats, source_images)
            reviewed: dict[str, dict] = {}  # review folder name -> its mode, answers, rows, answers left out
            if review_stores:  # the tasks reviewed that the partitions built: no second reading of the runs
                with ThreadPoolExecutor(max_workers=1) as hasher:
                    review_digests, reviewed = write_reviews(review_stores, staging, stats.reviewed_tasks, stats,
                                                             test_fraction, max_shard_bytes, hasher, review_reasons)
                digests.update(review_digests)
                configs += (REVIEW_CONFIG,)
            for exc in found_refused:  # folders and files refused while finding the units
                stats.add_refusal(exc, task_left_out=False)
            max_rounds = _max_rounds(units, stats if unsafe == "skip" else None)
            splits = ["train", "test"] if test_fraction > 0 else ["train"]
            files, final_digests = _finalize(staging, configs, splits, digests)
            figure = _draw_figure(stats, staging / FIGURE)
            sent = {run_dir.name: recorded_destinations(run_dir) for run_dir in _whole_runs(units)}
            partial = {run_dir.name: shards for run_dir in _whole_runs(units)
                       if (shards := recorded_partial(run_dir)) is not None}
            info = build_info(units, configs, splits, files, stats, test_fraction, max_shard_bytes, sources,
                              figure, unsafe, sent, partial)
            info.update({"reviews": reviewed} if reviewed else {})
            approval = expert_approval(stats, labels) if labels else None
            recorded = recorded_rules(_whole_runs(units))
            info["acceptance"] = {"rule": rule, "recorded_rules": recorded, "policy": _policy_summary(policy),
                                  "expert_approval": approval}
            (staging / BUILD_INFO).write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
            note = (f"Built by medbanana {info['medbanana_version']} with datasets {info['datasets_version']}; "
                    f"statistics in {BUILD_INFO}, checksums in SHA256SUMS (`medbanana verify`).{refused_note(stats)}"
                    f"{coerced_note(stats)}{partial_note(partial)}")
            card = render_card(stats, list(configs), {c: list(f) for c, f in files.items()},
                               max_rounds=max_rounds, test_fraction=test_fraction,
                               sources=sources, build_note=note, figure=figure,
                               signing=_signing(units), destinations=sent,
                               acceptance=acceptance_note(rule, policy, recorded, approval, md_escape))
            (staging / CARD).write_text(card, encoding="utf-8")
            write_manifest(staging, final_digests)
            move_into_place(staging, out)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)  # made by this build under the lock: all of it is its own
            raise
    return info


def _acceptance(accept: str | None) -> tuple[str | None, dict | None]:
    """`--accept`'s rule (as written, or a POLICY.json's) and the policy; BuildError for neither."""
    if accept is None:
        return None, None
    try:
        return rule_option(accept)
    except (ValueError, FileNotFoundError) as exc:
        raise BuildError(f"--accept: {exc}") from None


def _policy_summary(policy: dict | None) -> dict | None:
    """What medbanana-build.json keeps of the policy (not its labels: they stay in the policy file)."""
    if policy is None:
        return None
    return {key: policy.get(key) for key in ("rule", "target_precision", "delta", "method", "guarantee", "bound",
                                             "yield", "kappa", "created_at")} | {
        "labels": (policy.get("labels") or {}).get("matched")}


def _check_sources(stats: BuildStats, folder: Path | None) -> dict | None:
    """The source counts (None without --source-images); a folder that has no task's source is an error, not a
    build whose source_image is null everywhere."""
    if folder is None:
        return None
    counts = stats.source_counts()
    if counts["total"] and not counts["matched"]:
        raise BuildError(f"--source-images {folder}: no source image of the {counts['total']:,} tasks is there (it "
                         f"holds {len(SourceIndex(folder)):,} image file(s)); looked for e.g. "
                         f"{counts['missing_examples'][0]}")
    return counts


def _draw_figure(stats: BuildStats, path: Path) -> str | None:
    """Figure 3 beside the card (listed in SHA256SUMS like every file); None, with a warning, without matplotlib:
    the card never needs it."""
    try:
        require_matplotlib()
    except ImportError:
        warnings.warn(f"matplotlib is not installed: the card has no Figure 3 ({EVAL_EXTRA})", stacklevel=3)
        return None
    save_figure3(stats, path)
    return path.name


def discover_all(run_dirs: Sequence[Path], refused=None) -> list[Unit]:
    """The units of every run; a task may appear in only one of them. A folder or JSON file leading outside its
    run is refused: a BuildError, or passed to `refused` (policy skip)."""
    units: list[Unit] = []
    for run_dir in run_dirs:
        try:
            units.extend(discover_units(run_dir, refused))
        except (FileNotFoundError, ValueError) as exc:
            raise BuildError(error_line(exc)) from None
    by_name: dict[str, list[Unit]] = {}
    for unit in units:
        by_name.setdefault(unit.path.name, []).append(unit)
    for same in by_name.values():
        if len(same) > 1:  # the same {D}-edit folder in two runs: allowed only when their tasks differ
            seen: dict[str, Unit] = {}
            for unit in same:
                try:  # entries refused here are recorded when the unit is built
                    uids = task_keys(unit, (lambda exc: None) if refused is not None else None)
                except ValueError as exc:
                    raise BuildError(error_line(exc)) from None
                for uid in uids:
                    if uid in seen:
                        raise BuildError(f"task {uid} is in both {seen[uid].label} and {unit.label}; "
                                         "build each run once")
                    seen[uid] = unit
    return units


def plan_partitions(units: list[Unit], parts: int) -> list[list[tuple[Unit, int, int]]]:
    """Spread units over `parts` workers, largest first onto the least loaded, so each JSON file is decoded by
    one worker; with fewer units than workers, units are cut into blocks of tasks. Deterministic."""
    blocks = max(1, -(-parts // len(units)))
    items = [(unit_size(unit) / blocks, i, b) for i, unit in enumerate(units) for b in range(blocks)]
    loads, plan = [0.0] * parts, [[] for _ in range(parts)]
    for size, i, b in sorted(items, key=lambda item: (-item[0], item[1], item[2])):
        target = loads.index(min(loads))
        loads[target] += size
        plan[target].append((i, b))
    return [[(units[i], b, blocks) for i, b in sorted(assigned)] for assigned in plan if assigned]


def _run_partitions(specs: list[PartitionSpec], quiet: bool) -> tuple[BuildStats, dict[str, str]]:
    total, digests = BuildStats(), {}
    with tqdm(desc="medbanana build", unit=" tasks", disable=quiet) as bar:
        if len(specs) == 1:
            try:
                stats, digests = build_partition(specs[0], bar.update)
            except (ValueError, OSError) as exc:  # unreadable JSON, a full disk, ...: say which, no traceback
                raise BuildError(error_line(exc)) from exc
            total.merge(stats)
            return total, digests
        ctx = multiprocessing.get_context("spawn")  # pyarrow's thread pools do not survive fork
        messages = ctx.Queue()
        procs = [ctx.Process(target=partition_worker, args=(spec, messages), daemon=True) for spec in specs]
        with children_ignore_sigint():  # Ctrl-C is this process's to handle: it ends the workers
            for proc in procs:
                proc.start()
        finished: dict[int, BuildStats] = {}
        try:
            while len(finished) < len(specs):
                try:
                    kind, *rest = messages.get(timeout=1.0)
                except queue.Empty:
                    dead = [p for i, p in enumerate(procs) if i not in finished and p.exitcode not in (None, 0)]
                    if dead:
                        raise BuildError(f"a build worker died (exit code {dead[0].exitcode}); out of memory?") from None
                    continue
                if kind == "progress":
                    bar.update(rest[0])
                elif kind == "done":
                    finished[rest[0]] = rest[1][0]
                    digests.update(rest[1][1])
                else:
                    raise BuildError(rest[1])  # names the file and the reason
        finally:
            for proc in procs:
                if proc.is_alive() and len(finished) < len(specs):
                    proc.terminate()
                proc.join()
    for part in sorted(finished):  # in partition order, whichever finished first: the examples kept and the
        total.merge(finished[part])  # order of counts in medbanana-build.json do not depend on timing
    return total, digests


def _finalize(folder: Path, configs: tuple[str, ...], splits: list[str], digests: dict[str, str]):
    """Final shard names per config and split, and their digests by final relative path. Splits without rows get
    no files (datasets cannot load an empty split); a config without rows is left out of the card's `configs:`."""
    files: dict[str, dict[str, list[str]]] = {}
    final_digests: dict[str, str] = {}
    for config in configs:
        config_dir = folder / config
        if not config_dir.is_dir():
            continue
        named = finalize_shards(config_dir)
        files[config] = {}
        for split in splits:
            if split in named:
                files[config][split] = [new.relative_to(folder).as_posix() for _old, new in named[split]]
                final_digests.update({new.relative_to(folder).as_posix(): digests[str(old)]
                                      for old, new in named[split]})
    if not files:
        raise BuildError("the runs hold no task to build a row from")
    return files, final_digests


def _signing(units: list[Unit]) -> dict[str, int]:
    """Certificate fingerprint -> runs that signed their images with it (C2PA), for the card."""
    fingerprints = [recorded_signing(run_dir) for run_dir in _whole_runs(units)]
    return dict(sorted(Counter(f for f in fingerprints if f).items()))


def _max_rounds(units: list[Unit], stats: BuildStats | None) -> int:
    """The card's round limit: the largest a run recorded (policy skip, `stats`: a refused file is recorded)."""
    refused = (lambda exc: stats.add_refusal(exc, task_left_out=False)) if stats is not None else None
    try:
        found = [recorded_max_rounds(run_dir, refused) for run_dir in _whole_runs(units)]
    except ValueError as exc:
        raise BuildError(error_line(exc)) from None
    return max((n for n in found if n is not None), default=DEFAULT_MAX_ROUNDS)


def _whole_runs(units: list[Unit]) -> list[Path]:
    """The runs given whole, whose own files (medbanana-run.json) may be read: given one `{D}-edit` folder, its run's
    files lie outside what was named."""
    return sorted({u.run_dir for u in units if u.scope is None})
