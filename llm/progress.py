"""A one-line progress bar on a terminal, for `LLM.generate` over many prompts:

    Generating [##########..........] 20/40 prompts, 3.1 prompts/s

Drawn on stderr only when it is a terminal, so logs and pipes never see it; redrawn in place
(carriage return) and erased when done.
"""

import sys
import time
from typing import TextIO

# Characters of the bar itself.
BAR_WIDTH = 30
# Least seconds between redraws: a thousand short prompts must not mean a thousand writes.
REDRAW_S = 0.1


class Progress:
    """Counts finished prompts out of `total`, drawing when enabled."""

    def __init__(self, total: int, enabled: bool, stream: TextIO | None = None) -> None:
        self.total = total
        self.done = 0
        self._stream = stream or sys.stderr
        self._enabled = enabled
        self._started = time.monotonic()
        self._drawn_at = 0.0
        self._draw()

    @classmethod
    def on_terminal(cls, total: int, wanted: bool) -> "Progress":
        """Drawn when wanted, for more than one prompt, and stderr is a terminal."""
        return cls(total, wanted and total > 1 and sys.stderr.isatty())

    def advance(self) -> None:
        self.done += 1
        if self.done == self.total or time.monotonic() - self._drawn_at >= REDRAW_S:
            self._draw()

    def close(self) -> None:
        """Erase the line."""
        if self._enabled:
            self._stream.write("\r\033[K")
            self._stream.flush()

    def _draw(self) -> None:
        if not self._enabled:
            return
        self._drawn_at = time.monotonic()
        filled = BAR_WIDTH * self.done // max(self.total, 1)
        rate = self.done / max(self._drawn_at - self._started, 1e-9)
        self._stream.write(f"\rGenerating [{'#' * filled}{'.' * (BAR_WIDTH - filled)}] "
                           f"{self.done}/{self.total} prompts, {rate:.1f} prompts/s")
        self._stream.flush()
