"""`medbanana eval`'s exit code and the top reasons of failed samples (the codes and the grouping of messages are
generation/failures.py's, shared with `generate`)."""

from __future__ import annotations

import sys

from ..generation.failures import EXIT_INCOMPLETE, EXIT_OK, TOP, print_reasons, top_reasons


def eval_reasons(records, n: int = TOP) -> dict:
    """Top reasons of failed samples (`errors`) and of failed judge calls (`judge_errors`), as lists of
    {"reason", "samples"}."""
    records = list(records)
    errors = top_reasons((r.get("error") for r in records if r["status"] != "ok"), n)
    judge = top_reasons((r.get("judge_error") for r in records if r["status"] == "ok"), n)
    return {"errors": [{"reason": k, "samples": c} for k, c in errors],
            "judge_errors": [{"reason": k, "samples": c} for k, c in judge]}


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
            print_reasons([(r["reason"], r["samples"]) for r in reasons.get(key, [])], stream=stream)
    if ok == 0 or (judged and judge_errors == ok):
        what = "no sample could be scored" if ok == 0 else "the judge gave no verdict for any sample"
        print(f"medbanana eval: {what} (exit code {EXIT_INCOMPLETE})", file=stream)
        return EXIT_INCOMPLETE
    return EXIT_OK
