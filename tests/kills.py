"""Kill a writer with SIGKILL again and again, each time a little further into its run, as a crash would."""

import signal
import subprocess
import time
from pathlib import Path

from medbanana.generation.rundir.store import read_journal


def kill_repeatedly(start, journal: Path, tries: int, deadline: float = 30.0) -> int:
    """Start the writer (`start()` returns its Popen) `tries` times, killing it once the journal has grown by
    2, 3, 4, ... more lines than when it started; one that finishes first is not killed. Returns the kills."""
    kills = 0
    for _ in range(tries):
        before = len(read_journal(journal))
        proc: subprocess.Popen = start()
        ends = time.monotonic() + deadline
        while proc.poll() is None and time.monotonic() < ends:
            if len(read_journal(journal)) >= before + 2 + kills:
                proc.send_signal(signal.SIGKILL)
                kills += 1
                break
            time.sleep(0.005)
        proc.wait()
    return kills
