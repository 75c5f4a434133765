"""Ctrl-C belongs to the main process: it prints the one "interrupted" line (cli.py) and ends its children, which
must neither see the SIGINT that a terminal sends to the whole process group nor print a KeyboardInterrupt
traceback of their own.

A spawned Python child imports for a second or more before any code of ours runs in it, so ignoring SIGINT in
its entry function comes too late. `children_ignore_sigint()` blocks SIGINT in the starting thread while children
start instead: the blocked mask is inherited through fork and exec and a child keeps it for its life (it never
receives SIGINT), and a Ctrl-C pressed meanwhile stays pending in the parent, which gets it when the block ends.
`ignore_sigint` is a child's own first act as well (a process pool's initializer, a worker's entry), for children
forked without the block.

    with children_ignore_sigint():
        process.start()          # or pool.submit(...), which starts a pool's processes
"""

from __future__ import annotations

import signal
from contextlib import contextmanager


@contextmanager
def children_ignore_sigint():
    """Block SIGINT in this thread for the block: children started in it never see a Ctrl-C."""
    if not hasattr(signal, "pthread_sigmask"):  # Windows: no signal masks (Ctrl-C reaches the console's group)
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def ignore_sigint(*_) -> None:
    """SIGINT ignored in this process (a child's, whose parent handles Ctrl-C); takes and ignores any arguments,
    so that it can stand in as a pool's initializer."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
