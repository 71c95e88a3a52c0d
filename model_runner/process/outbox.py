"""A decode run's pushes on their way to the stream, merged while the stream lags (issue 35).

    outbox = Outbox()
    outbox.put(outputs)        # [the forward thread] a step's outputs, packed there
    answer = outbox.take()     # [the event loop] the next push to send, or None
    await outbox.wait()        # until a put (or a poke) since the last wait

The forward thread computes a followed session's steps back to back and the event loop sends
each as a push on the session's StepStream. Sending one costs the loop about as much however
many entries it carries (gRPC's per-message work), and the client decodes each message once.
So, as vLLM v1's `RequestOutputCollector` merges a delta output not yet taken with the next
one, a step whose previous push was not taken yet (the loop did not get to it, or the stream's
write of the push before is still pending: its generator is suspended meanwhile) is merged into
that push instead of queuing a second message: its entries follow the previous steps' (the same
seq id again, runner.proto's RunnerStepResponse), free_blocks the latest. A consumer that keeps
up gets one push per step; one that lags gets fewer, bigger messages, and no step waits longer
than it would have in the queue. The loop is woken once per message, not once per step.

Bound: a push takes another step while it stays within MAX_PUSH_ENTRIES entries (a sequence's
step and each of its top logprobs one each; a step bigger alone goes alone). At ~40 bytes an
entry on the wire at most, that is ~160 KiB: far under gRPC's 4 MiB message limit, and a client
decodes it in a few milliseconds. Beyond it, a second message queues behind the first, as
every step did before.
"""

import asyncio
import threading
from collections import deque

from pagedkv.client import StepOutputs
from pagedkv.proto import runner_pb2 as rpb

# The most entries (sequence steps plus top logprobs) a push takes more steps up to.
MAX_PUSH_ENTRIES = 4096


def entries(answer: rpb.RunnerStepResponse) -> int:
    """What `answer` counts against MAX_PUSH_ENTRIES."""
    return len(answer.seq_ids) + len(answer.top_token_ids)


def merge(pending: rpb.RunnerStepResponse, answer: rpb.RunnerStepResponse) -> None:
    """Append the next step's `answer` to the push not sent yet: each array's entries after
    the previous steps', free_blocks the latest (MergeFrom keeps the old one where the new one
    is 0)."""
    pending.MergeFrom(answer)
    pending.free_blocks = answer.free_blocks


class Outbox:
    """A decode run's answers not yet taken, the newest still taking steps (module docstring)."""

    def __init__(self, max_entries: int = MAX_PUSH_ENTRIES) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be at least 1, got {max_entries}")
        # The most entries a push takes more steps up to.
        self.max_entries = max_entries
        # Answers packed and not taken yet, oldest first; guarded by _lock (the forward thread
        # puts, the loop takes).
        self._answers: deque[rpb.RunnerStepResponse] = deque()
        self._lock = threading.Lock()
        self._wake = asyncio.Event()
        self._loop = asyncio.get_running_loop()

    def put(self, outputs: StepOutputs) -> None:
        """[the forward thread, or the loop] Pack a step's answer where it was computed and
        merge it into the push not taken yet if it fits, else queue it; wake the stream when
        the queue was empty (else its wake-up is on its way or it is draining the queue)."""
        answer = outputs.message()
        with self._lock:
            last = self._answers[-1] if self._answers else None
            if last is not None and entries(last) + entries(answer) <= self.max_entries:
                merge(last, answer)
                return
            self._answers.append(answer)
            if last is not None:
                return
        self._loop.call_soon_threadsafe(self._wake.set)

    def take(self) -> rpb.RunnerStepResponse | None:
        """[the loop] The oldest push, no longer merged into; None when none is queued."""
        with self._lock:
            return self._answers.popleft() if self._answers else None

    def poke(self, _: object = None) -> None:
        """[the loop] Wake the stream without a push (the run ended)."""
        self._wake.set()

    async def wait(self) -> None:
        """[the loop] Until a put or a poke since the last wait."""
        await self._wake.wait()
        self._wake.clear()
