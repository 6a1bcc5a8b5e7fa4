"""Progress from a ring's workers to the process that started them: a file the worker appends
lines to and the parent polls. A file, not a pipe or a queue, because it pickles into a task's
arguments as a path, nothing in the ring's result path changes, and a broken channel costs
only the progress: writing never fails the task, and the parent's poller stops with its block.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import threading
from collections.abc import Callable, Iterator


class ProgressFile:
    """A picklable progress callback for a ring task: each call appends one line to `path`."""

    def __init__(self, path: str):
        self.path = str(path)

    def __call__(self, text: str) -> None:
        line = (" ".join(str(text).split()) + "\n").encode("utf-8", "replace")
        try:
            with open(self.path, "ab") as f:
                f.write(line)  # one write of one whole line: the poller keeps partial lines for later
        except OSError:
            pass  # the parent is gone or its file too: the task goes on without progress

    def __repr__(self) -> str:
        return f"ProgressFile({self.path!r})"


@contextlib.contextmanager
def relay(callback: Callable[[str], None], *, interval: float = 0.1) -> Iterator[ProgressFile | None]:
    """A `ProgressFile` whose lines reach `callback` in this process, from a polling thread,
    while the block runs; the last lines are delivered and the file removed when it ends.
    Yields None (no progress) if no file can be made; a failing callback is ignored."""
    try:
        fd, path = tempfile.mkstemp(prefix="ringcheck-progress-", suffix=".txt")
        os.close(fd)
    except OSError:
        yield None
        return
    stop = threading.Event()

    def poll() -> None:
        offset, pending = 0, b""
        while True:
            stopping = stop.wait(interval)
            try:
                with open(path, "rb") as f:
                    f.seek(offset)
                    chunk = f.read()
            except OSError:
                chunk = b""
            offset += len(chunk)
            *lines, pending = (pending + chunk).split(b"\n")
            for line in lines:
                try:
                    callback(line.decode("utf-8", "replace"))
                except Exception:
                    pass
            if stopping:
                return

    thread = threading.Thread(target=poll, name="ringcheck-progress", daemon=True)
    thread.start()
    try:
        yield ProgressFile(path)
    finally:
        stop.set()
        thread.join(timeout=2.0)
        with contextlib.suppress(OSError):
            os.unlink(path)
