"""The run directory: an append-only journal as the source of truth, JSON files materialised from it.

Every finished round and every finished task is one JSON line in medbanana-journal.jsonl, written after its image
is in place (temp file + rename), and flushed. The original scripts' JSON files are rebuilt from the journal with
atomic renames at the end and at intervals, never rewritten per update. Reopening a run directory replays the
journal: finished tasks are skipped and unfinished ones continue after their last journalled round. A run may come
from elsewhere: its medbanana-run.json (schema.RunConfig) and every journal line (journal.py) are parsed and checked
before anything is written, and the journal, appended to, is opened only as a file of ours (files.open_owned).

One process writes a run directory at a time (lock.py), from `open` to `close`. Opening reconciles the disk with
the journal, since a kill can land between an image's rename and its journal line or in the middle of a temp
file: images no journal line names are removed when they carry this run's mark (a resumed round writes them
again) and moved to medbanana-orphans/ otherwise, their masks and the editor's originals removed (mask_files.py,
originals.py), stale temp files are removed, and a task with rounds journalled after its last "task" line (a killed
--retry-failed) is open again.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
import uuid
from collections import Counter, defaultdict
from pathlib import Path

from . import layout, layout_files, mask_files, originals
from .lock import DirLock
from .provenance import DEFAULT_SOURCE_TYPE, creator_tool, mark_synthetic, read_mark, xmp_text
from .journal import open_journal, parse_journal
from .schema import attempt_from_round, read_run_config
from ..records import Attempt, EditedImage, SourceImage, Task
from ..outcomes import ApiFailure, TaskOutcome, TaskStatus
from ..files import TEMP_NAME, atomic_write_bytes, atomic_write_json, open_append, read_jsonl, same_bytes
from ..failures import UsageError

FORMAT_VERSION = 1
# Keys of medbanana-run.json that must match when a run directory is reopened: other values would mix two runs.
IDENTITY_KEYS = ("format_version", "backends", "max_rounds", "accept", "seed", "c2pa", "geometry")
# recorded only since the key was added: a run made before it resumes under any value
NEWER_KEYS = ("geometry",)
# The most of a run's time periodic materialisation may take: at 50,000 finished tasks one takes ~20 s
# (bench/bench_materialize.py), which a fixed interval of 30 s would repeat nearly back to back.
MATERIALIZE_SHARE = 0.05


class RunConfigMismatch(UsageError, RuntimeError):
    """The run directory was started with another configuration."""


def read_journal(path: Path) -> list[dict]:
    """Journal lines in order; a torn last line (the process was killed mid-write) is ignored."""
    return read_jsonl(path)


class RunStore:
    def __init__(self, run_dir: Path, config: dict, signer=None, incoming: dict[Path, Path] | None = None):
        """`signer` (a signing.ImageSigner) signs every image written with a C2PA manifest; the run records its
        certificate's fingerprint, and reopening it with another certificate, or none, is refused. `incoming`:
        the images a merge is about to link in (resolved path here -> its file in a shard)."""
        self.run_dir = Path(run_dir)
        self.incoming = incoming or {}
        self.config = {"format_version": FORMAT_VERSION, **config}
        self.signer = signer
        if signer is not None:
            self.config["c2pa"] = signer.describe()
        self._source_sha256: dict[str, str] = {}  # source path -> SHA-256, named in each signed image
        self._signing = threading.Lock()  # images may be written by worker threads; signing is one at a time
        self.finished: dict[str, dict] = {}  # uid -> task record (last journal line wins)
        self.partial: dict[str, dict[int, dict]] = defaultdict(dict)  # uid -> round -> round json
        self.reopened: set[str] = set()  # finished as api_failed, with rounds journalled after that: to continue
        self.reconciled: Counter = Counter()  # what opening found and fixed (orphan_images, temp_files, ...)
        self._lock = DirLock(self.run_dir, "run directory")
        self._journal = None
        self._last_materialized = 0.0
        self._materialize_took = 0.0  # seconds the last materialisation took
        self._changed_pairs: set[tuple[str, str]] | None = None  # output folder pairs to write next (None: all)
        self._dirty = False  # journal lines since the last materialisation

    # --- opening and replay -------------------------------------------------------------------------------------
    def open(self) -> "RunStore":
        self._lock.acquire()  # first: two writers would interleave journal lines and images (LockHeld)
        try:
            return self._open()
        except BaseException:
            self._lock.release()
            raise

    def _open(self) -> "RunStore":
        leading_out = layout.folders_leading_out(self.run_dir)
        if leading_out:  # e.g. a run from elsewhere: its images would be written wherever its links point
            raise layout.UnsafePath(
                f"{self.run_dir / leading_out[0]} is a link leading outside the run directory"
                f"{f' (and {len(leading_out) - 1} more)' if len(leading_out) > 1 else ''}: a run writes only inside "
                "its folder; replace each such link by the folder itself")
        cfg_path = self.run_dir / layout.RUN_CONFIG
        old = read_run_config(self.run_dir, strict=True)  # a field of the wrong type: one line naming it
        if old is not None:
            _check_signing(self.run_dir, old.get("c2pa"), self.config.get("c2pa"))
            diffs = [f"{k}: was {old.get(k)!r}, now {self.config.get(k)!r}" for k in IDENTITY_KEYS
                     if old.get(k) != self.config.get(k) and (k in old or k not in NEWER_KEYS)]
            if diffs:
                raise RunConfigMismatch(f"{self.run_dir} belongs to a run with another configuration ("
                                        + "; ".join(diffs) + "). Use another --out folder, or the same options.")
            self.config = {**old, **self.config, "created": old.get("created", time.time())}
        else:
            if layout.find_output_dirs(self.run_dir):
                raise RunConfigMismatch(f"{self.run_dir} holds a run that was not made by medbanana "
                                        f"(no {layout.RUN_CONFIG}); use an empty folder")
            self.config["created"] = time.time()
        self.config.setdefault("run_id", uuid.uuid4().hex)
        journal_path = self.run_dir / layout.JOURNAL
        journal, data = open_journal(journal_path)  # every line parsed and checked before anything is written
        try:
            entries = [line.entry for line in parse_journal(data, f"run directory {self.run_dir}")]
            self._replay(entries)
            self._reconcile(entries)
            atomic_write_json(cfg_path, self.config)
            self._journal = journal or open_append(journal_path)
        except BaseException:
            if journal is not None:
                journal.close()
            raise
        if data and not data.endswith(b"\n"):
            self._journal.write(b"\n")  # after a torn line, start clean
        return self

    def _replay(self, entries: list[dict]) -> None:
        last_task, last_round = {}, {}
        for line, entry in enumerate(entries):
            uid = entry["uid"]
            if entry["type"] == "round":
                self.partial[uid][entry["round"]["round"]] = entry["round"]
                last_round[uid] = line
            elif entry["type"] == "task":
                self.finished[uid] = record = entry["record"]
                last_task[uid] = line
                # A task's record holds all its rounds: an api_failed one resumes after them (`history`), also
                # where no round line precedes it (a merged run's journal has records only).
                if record.get("status") == TaskStatus.API_FAILED:
                    self.partial[uid] = {r["round"]: r for r in record.get("rounds") or []}
                else:
                    self.partial.pop(uid, None)
        # A retry killed mid-task left rounds after the api_failed record: any resume continues from them. (After
        # a success or failed record only a second writer could have added rounds; the record stands.)
        self.reopened = {uid for uid, line in last_task.items() if last_round.get(uid, -1) > line
                         and self.finished[uid]["status"] == TaskStatus.API_FAILED}
        if self.reopened:
            self.reconciled["continued_tasks"] = len(self.reopened)

    def _reconcile(self, entries: list[dict]) -> None:
        """Images in the layout that no journal line names go (`_orphan`), and so do their masks; temp files of
        killed writes too."""
        named = set()
        for entry in entries:
            rounds = [entry["round"]] if entry["type"] == "round" else entry["record"].get("rounds") or []
            named.update(r["image"] for r in rounds if isinstance(r, dict) and r.get("image"))
            if entry["type"] == "task" and entry["record"].get("final_image"):
                named.add(entry["record"]["final_image"])
        for path in list(self.run_dir.iterdir()) if self.run_dir.is_dir() else []:
            if path.is_file() and TEMP_NAME.match(path.name):
                path.unlink()
                self.reconciled["temp_files"] += 1
            elif path.is_dir() and not path.is_symlink() and layout.is_layout_dir(path.name):
                for folder, _, files in os.walk(path):
                    for name in files:
                        file = Path(folder) / name
                        rel = file.relative_to(self.run_dir).as_posix()
                        if TEMP_NAME.match(name):
                            file.unlink()
                            self.reconciled["temp_files"] += 1
                        elif name.lower().endswith(layout.IMAGE_SUFFIXES) and rel not in named:
                            self._orphan(rel)
        mask_files.reconcile(self.run_dir, named, self.reconciled)
        originals.reconcile(self.run_dir, named, self.reconciled)

    def _orphan(self, rel: str) -> None:
        """An image no journal line names. One that a merge is about to link in, with its bytes, stays. One that
        carries this run's mark was written by it and killed before its journal line: worthless without its
        record, and a resumed round writes it again, so it goes. Any other (a user's file) is moved to
        ORPHANS/rel instead, never deleted."""
        path = self.run_dir / rel
        source = self.incoming.get(path.resolve())
        try:
            if source is not None and same_bytes(path, source):  # linked by a merge killed before its journal line
                return  # the merge goes on and keeps it
        except OSError:  # the shard's file is gone: this one is an orphan like any other
            pass
        try:
            mark = read_mark(path.read_bytes())
        except (OSError, ValueError):
            mark = None
        if mark is not None and self.config.get("run_id") and mark.run_id == xmp_text(self.config["run_id"]):
            path.unlink()
            self.reconciled["orphan_images"] += 1
            return
        target = self.run_dir / layout.ORPHANS / rel
        n = 0
        while target.exists():
            n += 1
            target = target.with_name(f"{Path(rel).stem}.{n}{Path(rel).suffix}")
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(path, target)
        self.reconciled["quarantined_images"] += 1

    def close(self) -> None:
        """Materialise the JSON files (if anything changed since), close the journal, release the directory."""
        try:
            if self._journal:
                if self._dirty or not self._last_materialized:
                    self.materialize()
                self._journal.close()
                self._journal = None
        finally:
            self._lock.release()

    def history(self, task: Task) -> list[Attempt]:
        """Rounds 1..k already journalled for an unfinished task whose images are on disk (a resume point)."""
        rounds = self.partial.get(task.uid, {})
        attempts = []
        for n in range(1, len(rounds) + 1):
            raw = rounds.get(n)
            if raw is None or (raw.get("image") and not (self.run_dir / raw["image"]).exists()):
                break
            attempts.append(attempt_from_round(raw))
        return attempts

    # --- writing ------------------------------------------------------------------------------------------------
    def _append(self, entry: dict) -> None:
        self._journal.write(json.dumps(entry, ensure_ascii=False).encode("utf-8") + b"\n")
        self._journal.flush()
        self._dirty = True

    def write_attempt(self, task: Task, attempt: Attempt, image: EditedImage | None,
                      masks: mask_files.MaskFiles | None = None) -> None:
        """A finished round: its image in place (`write_image`), then its journal line (`journal_attempt`)."""
        self.write_image(task, attempt, image, masks)
        self.journal_attempt(task, attempt)

    def write_image(self, task: Task, attempt: Attempt, image: EditedImage | None,
                    masks: mask_files.MaskFiles | None = None) -> None:
        """The round's image, marked (and signed), renamed into place after its masks (`masks`, computed here
        from the task's source when None: mask_files.py) and, for an edit the geometry guard registered, the
        editor's own image (originals.py); sets `attempt.image_relpath`. Safe on worker threads,
        several at once (the local runner hands it to one): it touches no shared state but the signer's, which a
        lock keeps to one thread, and the mask module's thread-safe cache of sources."""
        if image is None:
            return
        attempt.image_relpath = layout.attempt_image_relpath(task.dataset, task.direction, task.source_id,
                                                             task.disease, attempt.round, attempt.accepted)
        for relpath in (attempt.image_relpath, *layout.companion_relpaths(attempt.image_relpath)):
            layout.inside(self.run_dir, relpath, named_by="the run's layout")  # a link made since opening: refused
        # the companions first: a kill before the image's journal line leaves companions that opening removes
        mask_files.write(self.run_dir, attempt.image_relpath,
                         mask_files.compute(task, image.data, attempt.frame_rejected) if masks is None else masks)
        originals.write(self.run_dir, attempt.image_relpath,
                        None if image.original is None else self._marked(task, attempt, image.original, original=True))
        atomic_write_bytes(self.run_dir / attempt.image_relpath, self._marked(task, attempt, image.data))

    def _marked(self, task: Task, attempt: Attempt, data: bytes, original: bool = False) -> bytes:
        """Every image we write says it is synthetic (IPTC DigitalSourceType in XMP), pixels untouched, and is
        signed when the run signs."""
        extra = {"Task": task.uid, "Round": str(attempt.round)}
        if original:
            extra["Original"] = "the editor's image before the geometry guard registered it"
        marked = mark_synthetic(data, self.config["run_id"], self.config.get("models"),
                                source_type=self.config.get("digital_source_type", DEFAULT_SOURCE_TYPE), extra=extra)
        if self.signer is not None:  # after the mark: the signature covers the final bytes
            with self._signing:
                marked = self.signer.sign(marked, self._manifest(task, attempt))
        return marked

    def journal_attempt(self, task: Task, attempt: Attempt) -> None:
        """The round's journal line (after its image is in place); on the thread that owns the store."""
        raw = attempt.to_round_json()
        self.partial[task.uid][attempt.round] = raw
        self._append({"type": "round", "uid": task.uid, "round": raw})

    def _manifest(self, task: Task, attempt: Attempt) -> dict:
        from .signing import image_manifest

        provenance = {"run_id": self.config["run_id"], "task_uid": task.uid, "round": attempt.round,
                      "accepted": bool(attempt.accepted), "direction": task.direction, "disease": task.disease,
                      "instruction_sha256": hashlib.sha256(attempt.instruction.text.encode("utf-8")).hexdigest(),
                      "source_sha256": self.source_sha256(task, strict=True)}
        return image_manifest(title=Path(attempt.image_relpath).name,
                              source_type=self.config.get("digital_source_type", DEFAULT_SOURCE_TYPE),
                              models=self.config.get("models") or {}, generator=creator_tool(),
                              provenance=provenance)

    def source_sha256(self, task: Task, strict: bool = False) -> str | None:
        """The SHA-256 of the task's source file (each task record keeps it, so that a build given source images
        can tell they are the ones the run edited), None when it cannot be read (raised with `strict`)."""
        source = str(task.source_path)
        digest = self._source_sha256.get(source)  # one lookup: image writes may call this from other threads
        if digest is None:
            if len(self._source_sha256) > 4096:  # a task's rounds come together; old entries are not needed
                self._source_sha256.clear()
            try:
                digest = self._source_sha256[source] = SourceImage(Path(source)).sha256
            except OSError:
                if strict:
                    raise
                return None
        return digest

    def finish_task(self, outcome: TaskOutcome, extra: dict | None = None) -> dict:
        extra = {"source_sha256": self.source_sha256(outcome.task), **(extra or {})}
        record = conversation_record(outcome, self.run_dir, self.config, extra)
        self.add_finished(record)
        return record

    def add_finished(self, record: dict) -> None:
        """Journal a finished task's record (also used by merge, whose records come from other runs)."""
        self.finished[record["uid"]] = record
        self.partial.pop(record["uid"], None)
        self.reopened.discard(record["uid"])
        if self._changed_pairs is not None:
            self._changed_pairs.add(layout_files.folder_pair(record))
        self._append({"type": "task", "uid": record["uid"], "record": record})

    def maybe_materialize(self, every_seconds: float) -> None:
        """Materialise when `every_seconds` have passed since the last time, and the last one took at most
        MATERIALIZE_SHARE of the time since it ended: it blocks the event loop, and its cost grows with the run."""
        waited = time.monotonic() - self._last_materialized
        if waited >= max(every_seconds, self._materialize_took / MATERIALIZE_SHARE):
            self.materialize()

    # --- materialisation ----------------------------------------------------------------------------------------
    def materialize(self) -> None:
        """Rebuild the JSON files of the original layout (layout_files.py), atomically, of every output folder pair
        with a task finished since the last time: of all of them the first time after opening."""
        started = time.monotonic()
        pairs: dict[tuple[str, str], list[dict]] = defaultdict(list)
        for record in self.finished.values():
            pair = layout_files.folder_pair(record)
            if self._changed_pairs is None or pair in self._changed_pairs:
                pairs[pair].append(record)
        for (dataset, direction), records in sorted(pairs.items()):
            layout_files.write_folder_pair(self.run_dir, dataset, direction, records)
        self._changed_pairs = set()
        self._last_materialized = time.monotonic()
        self._materialize_took = self._last_materialized - started
        self._dirty = False


def _check_signing(run_dir: Path, recorded: dict | None, given: dict | None) -> None:
    """A run is signed throughout with one certificate, or not at all."""
    was = (recorded or {}).get("certificate_sha256")
    now = (given or {}).get("certificate_sha256")
    if was == now:
        return
    if was is None:
        raise RunConfigMismatch(f"{run_dir} was started without C2PA signing; resume it without --c2pa-cert/"
                                f"--c2pa-key (and their environment variables), or sign a new run with --out")
    if now is None:
        raise RunConfigMismatch(f"{run_dir} signs its images with the certificate of SHA-256 {was}; resume it "
                                f"with the same --c2pa-cert and --c2pa-key (or their environment variables)")
    raise RunConfigMismatch(f"{run_dir} signs its images with the certificate of SHA-256 {was}, not {now}; "
                            f"resume it with that certificate, or sign a new run with --out")


def conversation_record(outcome: TaskOutcome, run_dir: Path, config: dict, extra: dict) -> dict:
    """One all_conversations.json entry: the original fields first, then ours."""
    task = outcome.task
    last = outcome.attempts[-1] if outcome.attempts else None
    final_rel = last.image_relpath if last else ""
    record = {
        "image": task.source_path.name, "disease": task.disease, "status": outcome.status,
        "rounds": [a.to_round_json() for a in outcome.attempts],
        "final_prompt": last.instruction.text if last else "",
        "final_image_path": str((Path(run_dir) / final_rel).resolve()) if final_rel else "",
        # ours
        "key": task.key, "uid": task.uid, "dataset": task.dataset, "modality": task.modality,
        "task": task.direction, "source_id": task.source_id, "source_path": task.source_relpath,
        "success_round": outcome.success_round, "final_image": final_rel,
        "models": config.get("models", {}), "seed": config.get("seed"), **extra,
    }
    if outcome.failure:
        record["api_failure"] = api_failure_json(task, outcome.failure)
        record["error"] = {"step": outcome.failure.step, "kind": outcome.failure.kind,
                           "message": outcome.failure.error}
    return record


def api_failure_json(task: Task, failure: ApiFailure) -> dict:
    return {"task": task.key, "step": failure.step, "round": failure.round, "error": failure.error,
            "image": task.source_path.name, "disease": task.disease, "kind": failure.kind}
