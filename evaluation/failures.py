"""Exit codes of `medbanana generate` and `medbanana eval`, and the top failure reasons they print to stderr.

    0  generate: every task finished, accepted or failed after its rounds (a judged failure is a result).
       eval: at least one sample was scored (and judged, with a judge); failed samples are counted on stderr.
    2  a user error: bad options, an unknown disease, a folder made with other settings (cli.main).
    3  generate: some tasks ended api_failed (API errors, unreadable sources); `--retry-failed RUN_DIR` retries
       them. eval: no sample could be scored, or a judge was asked for and no sample got a verdict.
    4  generate: a process of the run died (a --workers child, a Ray shard after its retries; runners/processes.py).
   75  another process holds the run directory's or output folder's lock (generation/lock.py); try again later.
  130  interrupted (Ctrl-C); finished work is kept.
(`verify` has its own: 1 when a file does not match.)

Failure messages name files and objects, so they are grouped by a form with paths and addresses left out.
"""

from __future__ import annotations

import json
import re
import sys
from collections import Counter
from pathlib import Path

EXIT_OK = 0
EXIT_USAGE = 2
EXIT_INCOMPLETE = 3
TOP = 5  # reasons printed


def reason_key(message: str, limit: int = 160) -> str:
    """A failure message with what differs per sample left out: file paths and memory addresses.

    >>> reason_key("file not found: source /data/x/cxr-001.png; edited out/cxr-001.png")
    'file not found: source …; edited …'
    >>> reason_key("cannot identify image file <_io.BytesIO object at 0x7f3a2c>")
    'cannot identify image file <_io.BytesIO object at 0x…>'
    """
    text = re.sub(r"\b0x[0-9a-fA-F]+\b", "0x…", str(message))
    text = re.sub(r"""[^\s'"<>;,()]*[/\\][^\s'"<>;,()]*""", _path_or_token, text)
    text = re.sub(r"\s+", " ", text).strip()
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _path_or_token(match: re.Match) -> str:
    # "and/or" and "image/png" are words; a path starts at a root, has two separators or ends in an extension
    token = match.group(0)
    is_path = (token[0] in "/\\~." or re.match(r"[A-Za-z]:", token) or len(re.findall(r"[/\\]", token)) > 1
               or re.search(r"\.\w{1,5}$", token))
    return "…" if is_path else token


def top_reasons(messages, n: int = TOP) -> list[tuple[str, int]]:
    """The `n` most frequent reasons among `messages`, as (reason, count)."""
    return Counter(reason_key(m) for m in messages if m).most_common(n)


def print_reasons(reasons: list[tuple[str, int]], *, total_kinds: int | None = None, stream=None) -> None:
    stream = stream or sys.stderr
    for reason, count in reasons:
        print(f"  {count:>6,}  {reason}", file=stream)
    if total_kinds is not None and total_kinds > len(reasons):
        print(f"  ({total_kinds - len(reasons)} more reasons)", file=stream)


# ---------------------------------------------------------------- generate

def api_failures(run_dir: Path) -> list[dict]:
    """Every api_failed task's failure (task, step, kind, error) from the run's materialised api_failures.json."""
    from ..generation.rundir import layout

    found = []
    for _, _, folder in layout.find_output_dirs(Path(run_dir)):
        path = folder / layout.API_FAILURES
        if path.is_file():
            found += json.loads(path.read_text(encoding="utf-8"))
    return found


def failure_reasons(run_dir: Path, n: int = TOP) -> tuple[list[tuple[str, int]], int]:
    """(the `n` most frequent "kind at step: message" reasons, how many distinct ones there are)."""
    counts = Counter(f"{f.get('kind', 'api_error')} at {f.get('step', '?')}: {reason_key(f.get('error', ''))}"
                     for f in api_failures(run_dir))
    return counts.most_common(n), len(counts)


def generate_exit_code(summary, stream=None) -> int:
    """EXIT_INCOMPLETE, with the top reasons on stderr, when a task of the run directory ended api_failed."""
    stream = stream or sys.stderr
    failed = summary.statuses["api_failed"]
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
    print(f"retry them with: medbanana generate --retry-failed {summary.run_dir} (a source error needs its file "
          "fixed first)", file=stream)
    return EXIT_INCOMPLETE


# ---------------------------------------------------------------- eval

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
