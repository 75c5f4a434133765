"""`medbanana eval`'s exit code and the top reasons of failed samples (the codes and the grouping of messages are
generation/failures.py's, shared with `generate`)."""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

from ..generation.failures import EXIT_INCOMPLETE, EXIT_OK, TOP, print_reasons, top_reasons


def eval_reasons(records, n: int = TOP) -> dict:
    """Top reasons of failed samples (`errors`) and of failed judge calls (`judge_errors`), as lists of
    {"reason", "samples", "example"} (example: the file the reason's first message named, '' for none)."""
    records = list(records)
    errors = top_reasons((r.get("error") for r in records if r["status"] != "ok"), n)
    judge = top_reasons((r.get("judge_error") for r in records if r["status"] == "ok"), n)
    return {"errors": [{"reason": k, "samples": c, "example": e} for k, c, e in errors],
            "judge_errors": [{"reason": k, "samples": c, "example": e} for k, c, e in judge]}


def hints_shown_file() -> Path:
    """Where the hints `first_time` showed are recorded: $XDG_CACHE_HOME/medbanana/hints-shown (~/.cache/...)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "medbanana" / "hints-shown"


def first_time(hint: str) -> bool:
    """Whether `hint` (e.g. why LPIPS is not computed) is new on this machine, recording it as shown: a hint that
    tells what to install belongs on the first run's stderr, not on every one. Where nothing can be recorded,
    every time."""
    digest = hashlib.sha256(hint.encode("utf-8")).hexdigest()[:16]
    path = hints_shown_file()
    try:
        if digest in path.read_text(encoding="ascii").split():
            return False
    except (OSError, ValueError):
        pass
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a", encoding="ascii") as shown:
            shown.write(digest + "\n")
    except OSError:
        pass
    return True


def eval_exit_code(summary: dict, stream=None) -> int:
    """EXIT_INCOMPLETE when nothing was scored (or, with a judge, nothing judged); the reasons go to stderr
    whenever a sample or a judge call failed."""
    stream = stream or sys.stderr
    ok, errors, judge_errors = summary["ok"], summary["errors"], summary["judge_errors"]
    judged = summary.get("settings", {}).get("judge") is not None
    reasons = summary.get("failure_reasons", {})
    for count, what, key in ((errors, "samples could not be scored", "errors"),
                             (judge_errors, "samples have no verdict: the judge call failed", "judge_errors")):
        if count:
            print(f"medbanana eval: {count:,} of {summary['samples']:,} {what} (see samples.jsonl); top reasons:",
                  file=stream)
            print_reasons([(r["reason"], r["samples"], r.get("example", "")) for r in reasons.get(key, [])],
                          stream=stream)
    if ok == 0 or (judged and judge_errors == ok):
        what = "no sample could be scored" if ok == 0 else "the judge gave no verdict for any sample"
        print(f"medbanana eval: {what} (exit code {EXIT_INCOMPLETE})", file=stream)
        return EXIT_INCOMPLETE
    return EXIT_OK
