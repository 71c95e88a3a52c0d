"""Run a function in a forked child process, as another user when asked, and get its answer.

The child is a real process with its own credentials (the kernel records them for
SO_PEERCRED), without exec: another user cannot read the test's interpreter, so the child runs
what the test process has already imported. It drops to `uid`/`gid`/`groups` first, runs `work`,
and writes its answer (or the error it raised, as "error: <type>: <message>") to a pipe.
"""

import os
from collections.abc import Callable, Sequence

# What the child's answer may hold; longer answers are cut.
MAX_ANSWER_BYTES = 4096


def run_forked(work: Callable[[], str], *, uid: int | None = None, gid: int | None = None,
               groups: Sequence[int] = ()) -> str:
    """`work()`'s answer from a forked child running as `uid` (with `gid` and supplementary
    `groups`), or "error: ..." naming what it raised."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into the test
        os.close(read)
        try:
            if uid is not None:
                os.setgroups(list(groups))
                os.setgid(gid if gid is not None else uid)
                os.setuid(uid)
            answer = work()
        except BaseException as exc:  # everything goes back to the parent
            answer = f"error: {type(exc).__name__}: {exc}"
        os.write(write, answer.encode()[:MAX_ANSWER_BYTES])
        os._exit(0)
    os.close(write)
    try:
        with os.fdopen(read, "rb") as answer_pipe:
            answer = answer_pipe.read().decode()
    finally:
        os.waitpid(pid, 0)
    return answer
