"""`medbanana generate`'s exit code: EXIT_INCOMPLETE, with the top reasons on stderr, when tasks ended api_failed."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ..failures import EXIT_INCOMPLETE, EXIT_OK, TOP, print_reasons, reason_key, top_reasons
from ..outcomes import FailureKind, TaskStatus
from ..rundir import layout


def api_failures(run_dir: Path) -> list[dict]:
    """Every api_failed task's failure (task, step, kind, error) from the run's materialised api_failures.json."""
    found = []
    for _, _, folder in layout.find_output_dirs(Path(run_dir)):
        path = folder / layout.API_FAILURES
        if path.is_file():
            found += json.loads(path.read_text(encoding="utf-8"))
    return found


def failure_reasons(run_dir: Path, n: int = TOP) -> tuple[list[tuple[str, int, str]], int]:
    """(the `n` most frequent "kind at step: message" reasons, each with its count and the file its first message
    named, and how many distinct reasons there are)."""
    messages = [f"{f.get('kind', FailureKind.API_ERROR)} at {f.get('step', '?')}: {f.get('error', '')}"
                for f in api_failures(run_dir)]
    return top_reasons(messages, n), len({reason_key(m) for m in messages})


def generate_exit_code(summary, stream=None) -> int:
    """EXIT_INCOMPLETE, with the top reasons on stderr, when a task of the run directory ended api_failed (those
    dropped for a deleted source aside: they are said, not counted)."""
    stream = stream or sys.stderr
    if summary.dropped:
        print(f"medbanana generate: {summary.dropped:,} api_failed task(s) dropped: their source file is gone "
              "(kept in the records with kind source_missing; not retried again)", file=stream)
    if summary.missing_sources:
        print(f"medbanana generate: {len(summary.missing_sources):,} api_failed task(s) cannot be retried: their "
              f"source file is gone (first: {summary.missing_sources[0]}); restore it, or end them with "
              f"{retry_command(summary.run_dir)} --drop-missing-sources", file=stream)
    failed = summary.statuses[TaskStatus.API_FAILED] - summary.error_kinds[FailureKind.SOURCE_MISSING]
    if not failed:
        return EXIT_OK
    total = sum(summary.statuses.values())
    print(f"medbanana generate: {failed:,} of {total:,} tasks ended api_failed (exit code {EXIT_INCOMPLETE}); "
          "top reasons (kind at step: message):", file=stream)
    reasons, distinct = failure_reasons(summary.run_dir)
    if reasons:
        print_reasons(reasons, total_kinds=distinct, stream=stream)
    else:  # the JSON files were not materialised (an interrupted close): the kinds at least
        print_reasons(summary.error_kinds.most_common(TOP), stream=stream)
    print(f"retry them with: {retry_command(summary.run_dir)} (a source error needs its file fixed first)",
          file=stream)
    return EXIT_INCOMPLETE


def retry_command(run_dir: Path) -> str:
    """`medbanana generate --retry-failed RUN_DIR` with what the run records of its destinations (confirm.py: a
    retry gives them itself), as one line to type."""
    from ..rundir import schema
    from .confirm import recorded_options, shown

    try:
        config = schema.read_run_config(run_dir) or {}
    except ValueError:
        config = {}
    return f"medbanana generate {shown([('--retry-failed', str(run_dir)), *recorded_options(config)])}"
