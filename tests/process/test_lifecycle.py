"""process/lifecycle.py's exit: `exit_now` ends a process with its status and its output
flushed, skipping only the interpreter's teardown (the `python -m` entry points end with it)."""

import subprocess
import sys


def test_exit_now_keeps_the_status_and_flushes_what_was_written() -> None:
    script = ("import sys\nfrom pagedkv.process.lifecycle import exit_now\n"
              "print('answer', end='')\nsys.stderr.write('log line')\n"
              "import atexit\natexit.register(print, 'teardown ran')\nexit_now(3)\n")
    ended = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                           timeout=60)
    assert ended.returncode == 3
    assert ended.stdout == "answer"  # buffered (a pipe), flushed; atexit never ran
    assert ended.stderr == "log line"
