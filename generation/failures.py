"""Exit codes of the commands (the one table: docs/exit-codes.md says them to users), the error type of a user's
mistake, and the grouping of failure messages into the top reasons they print to stderr (`medbanana generate`:
commands/exit_codes.py; `medbanana eval`: evaluation/failures.py).

    0  generate: every task finished, accepted or failed after its rounds (a judged failure is a result).
       eval: at least one sample was scored (and judged, with a judge); failed samples are counted on stderr.
    1  a bug or an unforeseen failure: its traceback (cli.main). verify: a file does not match.
    2  a user error (`UsageError`): bad options, an unknown disease, a folder made with other settings (cli.main).
    3  generate: some tasks ended api_failed (API errors, unreadable sources); `--retry-failed RUN_DIR` retries
       them. eval: no sample could be scored, or a judge was asked for and no sample got a verdict.
    4  generate: a process of the run died (`WorkerCrashed`: a --workers child, a Ray shard after its retries).
    5  generate: the --budget was reached: no more rounds started, finished work is kept; the same command with a
       higher --budget goes on (runners/budget.py).
   75  another process holds the run directory's or output folder's lock (generation/rundir/lock.py); try again later.
  130  interrupted (Ctrl-C); finished work is kept.

Failure messages name files and objects, so they are grouped by a form with paths and addresses left out; each
reason printed names what its first message named (`e.g. /data/x/cxr-001.png`), so that a line says which file.
"""

from __future__ import annotations

import re
import sys
from collections import Counter

EXIT_OK = 0
EXIT_FAILURE = 1  # a bug or an unforeseen failure (its traceback); verify: a file does not match
EXIT_USAGE = 2  # a UsageError
EXIT_INCOMPLETE = 3
EXIT_INFRASTRUCTURE = 4  # a process of the run died: not the user's error nor the API's
EXIT_BUDGET = 5  # generate --budget: the next round would not fit
EXIT_LOCKED = 75  # sysexits' EX_TEMPFAIL: nothing is wrong with the command, try again when the other one ends
EXIT_INTERRUPTED = 130  # Ctrl-C (128 + SIGINT)
TOP = 5  # reasons printed


class UsageError(ValueError):
    """A mistake the user can fix (an option, a file or folder named, what it holds): `medbanana` prints its message
    as one line and exits EXIT_USAGE. Every other exception is a bug or an unforeseen failure and keeps its
    traceback. A ValueError, so that a library caller's `except ValueError` still catches it."""

    exit_code = EXIT_USAGE


class NotFound(UsageError, FileNotFoundError):
    """A file or folder the user named is not there (a FileNotFoundError too, for callers that catch that)."""


class WorkerCrashed(RuntimeError):
    """A worker process ended before finishing its tasks (a `--workers` child, a Ray shard after its retries);
    the CLI prints it as one line and exits with `exit_code`."""

    exit_code = EXIT_INFRASTRUCTURE


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


def elided(message: str) -> str:
    """What `reason_key` leaves out of `message`, in order (its paths), as one text: a reason's example.

    >>> elided("file not found: source /data/x/cxr-001.png; edited out/cxr-001.png")
    '/data/x/cxr-001.png, out/cxr-001.png'
    >>> elided("/data/x/cxr-002.jpeg: not a readable image")
    '/data/x/cxr-002.jpeg'
    """
    paths = [m.group(0).rstrip(":.") for m in re.finditer(r"""[^\s'"<>;,()]*[/\\][^\s'"<>;,()]*""", str(message))
             if _path_or_token(m) == "…"]
    return ", ".join(dict.fromkeys(paths))


def _path_or_token(match: re.Match) -> str:
    # "and/or" and "image/png" are words; a path starts at a root, has two separators or ends in an extension
    token = match.group(0)
    is_path = (token[0] in "/\\~." or re.match(r"[A-Za-z]:", token) or len(re.findall(r"[/\\]", token)) > 1
               or re.search(r"\.\w{1,5}$", token))
    return "…" if is_path else token


def top_reasons(messages, n: int = TOP) -> list[tuple[str, int, str]]:
    """The `n` most frequent reasons among `messages`, as (reason, count, example: what the reason's first
    message named, '' when it named nothing)."""
    counts: Counter = Counter()
    examples: dict[str, str] = {}
    for message in messages:
        if message:
            key = reason_key(message)
            counts[key] += 1
            examples.setdefault(key, elided(message))
    return [(reason, count, examples[reason]) for reason, count in counts.most_common(n)]


def print_reasons(reasons: list[tuple], *, total_kinds: int | None = None, stream=None) -> None:
    """One line per (reason, count[, example]): the count, the reason, and what its first message named."""
    stream = stream or sys.stderr
    for reason, count, *example in reasons:
        named = f" (e.g. {example[0]})" if example and example[0] else ""
        print(f"  {count:>6,}  {reason}{named}", file=stream)
    if total_kinds is not None and total_kinds > len(reasons):
        print(f"  ({total_kinds - len(reasons)} more reasons)", file=stream)
