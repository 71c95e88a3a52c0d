"""A monotonic clock the test moves by hand: the daemon's clock for leases and holds, so they
end when the test says, not by wall-clock time (`clock` fixture, tests/conftest.py)."""


class HandClock:
    """Monotonic seconds, moved only by the test."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, ms: float) -> None:
        self.now += ms / 1000
