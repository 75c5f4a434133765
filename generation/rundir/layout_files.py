"""The original scripts' JSON files of one output folder pair ({D}-edit or {D}-remove and its -failed sibling),
written from the finished task records the store holds, each file by an atomic rename.

The store (store.py) calls `write_folder_pair` for every pair with a task finished since it last did, at the end of
a run and at intervals (`RunStore.maybe_materialize`): the files are derived from the journal and may lag it.
"""

from __future__ import annotations

from pathlib import Path

from . import layout
from ..files import atomic_write_json
from ..outcomes import ENDED, TaskStatus

PRIVATE_KEYS = ("key", "api_failure")  # a record's fields that all_conversations.json leaves out


def folder_pair(record: dict) -> tuple[str, str]:
    """(dataset, direction): the output folder pair a task record's files belong to."""
    return record["dataset"], record["task"]


def write_folder_pair(run_dir: Path, dataset: str, direction: str, records: list[dict]) -> None:
    """progress.json, api_failures.json, final_prompts.json and all_conversations.json of the pair, and its
    failed_summary.json when a task failed, from all of the pair's finished `records`, in uid order."""
    records = sorted(records, key=lambda r: r["uid"])
    out = layout.output_dir(run_dir, dataset, direction)
    judged = [r for r in records if r["status"] in ENDED]
    # a record read back (a resume, a merge) has been checked (journal.py), but the schema's optional fields may be
    # missing from it: read with .get
    atomic_write_json(out / layout.PROGRESS, {r["key"]: r["status"] for r in records})
    atomic_write_json(out / layout.API_FAILURES, [r["api_failure"] for r in records if r.get("api_failure")])
    atomic_write_json(out / layout.FINAL_PROMPTS, {
        r["key"]: {"image": r.get("image"), "disease": r["disease"], "status": r["status"],
                   "final_prompt": r.get("final_prompt"), "rounds": len(r.get("rounds") or [])}
        for r in judged})
    atomic_write_json(out / layout.ALL_CONVERSATIONS, {r["key"]: _public(r) for r in records})
    failed = [r for r in records if r["status"] == TaskStatus.FAILED]
    if failed:
        atomic_write_json(layout.failed_dir(run_dir, dataset, direction) / layout.FAILED_SUMMARY, [
            {"task": r["key"], "image": r.get("image"), "disease": r["disease"],
             "final_prompt": r.get("final_prompt"), "rounds": len(r.get("rounds") or []),
             "last_verification": ((r.get("rounds") or [{}])[-1]).get("verification"),
             "final_image_path": r.get("final_image_path"), "full_conversation": _public(r)}
            for r in failed])


def _public(record: dict) -> dict:
    return {k: v for k, v in record.items() if k not in PRIVATE_KEYS}
