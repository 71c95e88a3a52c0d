"""The client's engine: requests in, one runner step per iteration, outputs out.

    daemon = "unix:///run/pagedkv/pagedkvd.sock"
    runner = "unix:///run/pagedkv-runner/pagedkv-runner.sock"
    async with await Engine.connect(daemon=daemon, runner=runner) as engine:
        out = await engine.generate([1, 2, 3], SamplingParams(temperature=0, max_tokens=8))
        async for partial in engine.stream([1, 2, 3], SamplingParams(max_tokens=8)):
            print(partial.outputs[0].token_ids)

One engine is one client of the pool: its own daemon session (a lease kept alive in the
background, so a dying client's blocks come back within its lease) and a runner that computes
for it. A background task loops: plan a step (`Scheduler`), send it to the runner (one message
on the session's Runner.StepStream), hand the answers back, and push each request's progress to
its waiter (`stream`: an output per step; `generate`: the final one only). Each step goes with
runner.proto's `follow`: while the next plan would be the same decode step again, the runner
takes it by itself and pushes its answer, which the engine applies as that step's
(`Following`); the engine sends only when its plan changes. A failed step
changed nothing (the runner's contract), so the plan is simply dropped: admissions wait again,
and a pool that turned out fuller than the runner last said preempts the newest request. A
runner that restarts under the engine (the KV stays in the daemon) gets the step again with
each sequence's history (`RunnerLink`), and the requests go on with the tokens they would have
had; a stream that breaks while the runner follows may have lost pushes, so the followed
requests are released and computed again from the tokens read, as after a preemption.
"""

import asyncio
import contextlib
import itertools
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Self

import grpc

from pagedkv.client.engine.follow import Following
from pagedkv.client.engine.outputs import RequestOutput
from pagedkv.client.engine.requests import Request
from pagedkv.client.engine.runner_link import RESTART_WAIT_S, RunnerLink
from pagedkv.client.engine.scheduler import Plan, Scheduler, SchedulerConfig
from pagedkv.client.pool.client import PoolClient
from pagedkv.client.pool.errors import OutcomeUnknown, PagedKVError, PoolExhausted, StalePlan
from pagedkv.client.pool.runner_client import RunnerClient, StepOutputs
from pagedkv.client.pool.sampling_params import SamplingParams
from pagedkv.client.pool.session import Session
from pagedkv.vocab.token_ids import check_vocabulary

# How often an idle engine whose next request does not fit reads the pool's free blocks again.
ROOM_POLL_S = 0.05
# How long close waits for the runner to release the engine's sequences (its forwards first).
CLOSE_RELEASE_S = 10.0


@dataclass(frozen=True, slots=True)
class StepRecord:
    """What one step did, for reports and plots (`Engine.observers`)."""

    # Seconds since the engine started.
    time_s: float
    # Sequences stepped, tokens sent to compute (an upper bound for prefills), tokens sampled.
    num_seqs: int
    num_tokens: int
    num_sampled: int
    # Requests running and waiting after the step, and the pool's free blocks.
    running_seqs: int
    waiting: int
    free_blocks: int
    # The client's own time on this step (planning and handling answers), seconds.
    schedule_s: float


class Engine:
    """Continuous batching over one daemon session and one runner."""

    def __init__(self, pool: PoolClient, session: Session, runner: RunnerClient, *,
                 vocab_size: int, eos_token_ids: Sequence[int], num_blocks: int,
                 free_blocks: int, config: SchedulerConfig, reservation_blocks: int = 0,
                 max_model_len: int = 0, runner_id: str = "",
                 runner_restart_wait_s: float = RESTART_WAIT_S) -> None:
        self.pool = pool
        self.session = session
        self.runner = runner
        # The runner's steps, carried across its restarts (runner_id: RunnerInfo's; a step
        # that got no answer waits up to runner_restart_wait_s for a restarted runner).
        self.link = RunnerLink(runner, session, runner_id, restart_wait_s=runner_restart_wait_s)
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        # The most tokens a sequence may hold (the runner's RunnerInfo.max_model_len; 0 = none).
        self.max_model_len = max_model_len
        self.scheduler = Scheduler(config, session.block_size, num_blocks, reservation_blocks)
        self.num_blocks = num_blocks
        # Called with each step's record (from the engine's task).
        self.observers: list[Callable[[StepRecord], None]] = []
        self.num_steps = 0
        self.peak_running_seqs = 0
        self._free_blocks = free_blocks
        self._seq_ids = itertools.count()
        self._request_ids = itertools.count()
        self._streams: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        # Requests whose waiter wants only the final output (`generate`).
        self._final_only: set[str] = set()
        # Finished requests whose sequences the next step releases: their final output is
        # published once that step is answered, so a finished request holds no blocks.
        self._finals: list[Request] = []
        self._wake = asyncio.Event()
        # The step being sent, until it is answered (close releases its sequences too).
        self._in_flight: Plan | None = None
        # Send steps with runner.proto's `follow` (needs a step stream), and what the runner
        # then steps by itself.
        self._follow = config.follow and runner.streams is not None
        self.following = Following()
        # Steps the runner took by itself and pushed (applied here).
        self.num_pushed = 0
        self._started = time.monotonic()
        self._task = asyncio.create_task(self._loop(), name="pagedkv-engine")

    @classmethod
    async def connect(cls, daemon: str, runner: str, *,
                      config: SchedulerConfig | None = None, client_name: str = "engine",
                      auth_token: str | None = None, cache_salt: bytes | str = b"",
                      lease_ttl_ms: int = 0,
                      runner_restart_wait_s: float = RESTART_WAIT_S) -> Self:
        """Open a session on the daemon and a channel to the runner computing on its pool.
        `runner_restart_wait_s`: how long a step that got no answer waits for a restarted
        runner (0 when nothing restarts it) before its requests fail."""
        pool = await PoolClient.connect(daemon, auth_token=auth_token)
        try:
            session = await pool.open_session(client_name, lease_ttl_ms, cache_salt=cache_salt)
            # Its steps go on one Runner.StepStream (a message costs a third of a Step call).
            runner_client = await RunnerClient.connect(runner, stream_steps=True)
            info = await runner_client.info()
            if info.pool_id != session.pool_id:
                await runner_client.close()
                raise ValueError(f"the runner at {runner} computes on pool {info.pool_id}, not "
                                 f"on the pool of the daemon at {daemon} ({session.pool_id})")
            stats = await session.stats()
            reservation = (await pool.pool_info()).reservation_blocks
        except BaseException:
            await pool.close()
            raise
        return cls(pool, session, runner_client, vocab_size=info.vocab_size,
                   eos_token_ids=info.eos_token_ids, num_blocks=stats.num_blocks,
                   free_blocks=stats.free_blocks, config=config or SchedulerConfig(),
                   reservation_blocks=reservation, max_model_len=info.max_model_len,
                   runner_id=info.runner_id, runner_restart_wait_s=runner_restart_wait_s)

    # ------------------------------------------------------------------ requests

    async def generate(self, prompt_token_ids: Sequence[int],
                       params: SamplingParams | None = None,
                       request_id: str | None = None) -> RequestOutput:
        """Generate to the end; the final output."""
        final = None
        async for output in self._outputs(prompt_token_ids, params, request_id, False):
            final = output
        assert final is not None and final.finished
        return final

    def stream(self, prompt_token_ids: Sequence[int], params: SamplingParams | None = None,
               request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """The request's output after each step that changed it; the last one is finished."""
        return self._outputs(prompt_token_ids, params, request_id, True)

    async def _outputs(self, prompt_token_ids: Sequence[int], params: SamplingParams | None,
                       request_id: str | None, every_step: bool) -> AsyncIterator[RequestOutput]:
        """The request's outputs: after each step that changed it, or only the final one (an
        output per step costs the engine's loop a copy of every token so far)."""
        request = self._request(prompt_token_ids, params or SamplingParams(), request_id)
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._streams[request.request_id] = queue
        if not every_step:
            self._final_only.add(request.request_id)
        self.scheduler.add(request)
        self._wake.set()
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    return
        finally:  # finished, failed, or its caller went away: then free it
            self._streams.pop(request.request_id, None)
            self._final_only.discard(request.request_id)
            if not request.finished:
                self.scheduler.abort(request)
                self._wake.set()

    def _request(self, prompt: Sequence[int], params: SamplingParams,
                 request_id: str | None) -> Request:
        if not prompt:
            raise ValueError("the prompt has no tokens")
        check_vocabulary(prompt, self.vocab_size, "prompt")
        limit = self.max_model_len
        if limit and len(prompt) > limit:
            raise ValueError(f"the prompt has {len(prompt)} tokens; the model takes at most "
                             f"{limit} positions (max_model_len)")
        if limit and params.beam_width and len(prompt) + params.max_tokens > limit:
            raise ValueError(f"beam search over {len(prompt)} prompt tokens + max_tokens "
                             f"{params.max_tokens} exceeds the model's {limit} positions "
                             "(max_model_len): lower max_tokens")
        name = request_id if request_id is not None else f"req-{next(self._request_ids)}"
        if name in self._streams:
            raise ValueError(f"request id {name!r} is already running")
        return Request(name, prompt, params, lambda: next(self._seq_ids), self.eos_token_ids)

    # ------------------------------------------------------------------ the loop

    async def _loop(self) -> None:
        try:
            await self._steps()
        except Exception as exc:  # a bug or a lost daemon: no waiter may hang
            for queue in self._streams.values():
                queue.put_nowait(exc)
            raise

    async def _steps(self) -> None:
        exhausted = stale = 0
        while True:
            if await self._take_push(wait=False):  # pushes sent before the engine's last message
                continue
            if not self.scheduler.has_work:
                self._publish_finals(self._finals)
                self._wake.clear()
                await self._wake.wait()
                continue
            began = time.monotonic()
            self._wake.clear()  # what arrives from now on is in no plan yet
            finals, self._finals = self._finals, []
            plan = self.scheduler.plan(self._free_blocks)
            if not finals and self.following.covers(plan):  # the runner steps it by itself
                await self._take_push(wait=True)
                continue
            self.following.stop()  # the runner stops following at the engine's next message
            if plan.preempt:
                self._finals = finals
                await self._preempt(plan)
                continue
            planned = time.monotonic() - began
            if not plan.steps and not plan.release:
                self._finals = finals
                await self._wait_for_room()
                continue
            # The runner may have stepped the followed sequences past the pushes read here: a
            # lost answer is then not resent with histories but computed again (`_recompute`).
            unseen = bool(self.following.implied.seqs)
            try:
                self._in_flight = plan
                outputs = await self.link.step(plan.seqs, plan.steps, plan.release,
                                               follow=self._follow, resend=not unseen)
                self._in_flight = None
            except OutcomeUnknown as exc:
                self._finals = finals
                if unseen:
                    await self._recompute(plan)
                else:
                    self._fail(plan, exc)
                continue
            except StalePlan as exc:  # planned before pushes not read yet: read, plan again
                self._finals = finals
                stale += 1
                if stale > 1:  # the runner stopped following at the first: never twice
                    self._fail(plan, exc)
                    continue
                self.scheduler.unadmit(plan)
                continue
            except PoolExhausted:
                self._finals = finals
                exhausted += 1
                await self._exhausted(plan, exhausted)
                continue
            except PagedKVError as exc:
                self._finals = finals
                self._fail(plan, exc)
                continue
            exhausted = stale = 0
            self.following.answered(plan, outputs, self._follow)
            self._publish_finals(finals)
            self._answered(plan, outputs, planned)

    def _answered(self, plan: Plan, outputs: StepOutputs, planned: float) -> None:
        """Apply the answer to `plan` (a step the engine sent, or one the runner took by itself
        and pushed) and publish what progressed; `planned`: seconds spent planning it."""
        began = time.monotonic()
        self._free_blocks = outputs.free_blocks
        progressed = self.scheduler.update(plan, outputs)
        for request in progressed:
            if request.finished:
                self._finals.append(request)
            elif request.request_id not in self._final_only:
                self._publish(request)
        self._observe(plan, outputs.free_blocks, planned + time.monotonic() - began,
                      sum(out.sampled for out in outputs))

    async def _take_push(self, wait: bool) -> bool:
        """Apply the runner's next push if one came (`wait`: until one comes or the engine is
        woken: a request arrived or was aborted); whether one was taken. A failed push ends
        the following as the same step of the engine's would have failed; a broken stream
        (pushes may be lost) computes the followed requests again, as preempted."""
        if not self.following.implied.seqs:
            return False
        try:
            pushed = await self._next_push() if wait else self.runner.take_push(self.session)
        except PoolExhausted:  # nothing changed: the engine's own step meets it next
            self.following.stop()
            return False
        except OutcomeUnknown:
            await self._lost_following()
            return False
        except PagedKVError as exc:
            implied = self.following.implied
            self.following.stop()
            self._fail(implied, exc)
            return False
        if pushed is None:
            return False
        self.num_pushed += 1
        plan, outputs = self.following.pushed(pushed)
        self._answered(plan, StepOutputs(outputs, pushed.free_blocks), 0.0)
        return True

    async def _next_push(self) -> StepOutputs | None:
        """The runner's next push, or None if the engine was woken first (the push waits)."""
        push = asyncio.ensure_future(self.runner.next_push(self.session))
        woken = asyncio.ensure_future(self._wake.wait())
        try:
            await asyncio.wait((push, woken), return_when=asyncio.FIRST_COMPLETED)
        finally:
            woken.cancel()
            if not push.done():
                push.cancel()  # only its wait: the push stays queued on the stream
        return push.result() if push.done() and not push.cancelled() else None

    async def _lost_following(self) -> None:
        """The stream broke while the runner followed: it may have stepped the followed
        sequences past the pushes read here. Release them and compute their requests again
        from the tokens read (the runner.proto rule): the prefix cache serves what was
        committed."""
        running = [r for r in self.following.lost() if r in self.scheduler.running]
        if running:
            await self._preempt(Plan(preempt=running))

    async def _recompute(self, plan: Plan) -> None:
        """`plan`, sent while the runner had followed the session, got no answer: release
        every sequence it or the following may have stepped (its admissions' included, which
        it may have allocated) and compute their requests again, as preempted."""
        self.scheduler.unadmit(plan)
        admitted = [seq.seq_id for request in plan.admit for seq in request.seqs]
        followed = self.following.lost()
        preempt = Plan(preempt=[request for request in dict.fromkeys([*plan.owners, *followed])
                                if request in self.scheduler.running])
        outputs = await self.link.step([], [], [*self.scheduler.preempt_ids(preempt), *admitted])
        self._free_blocks = outputs.free_blocks
        self.scheduler.preempted(preempt)

    async def _wait_for_room(self) -> None:
        """Nothing runs and the oldest waiting request does not fit now: other clients hold
        the pool. Fail it if it could never fit; else read the free blocks again shortly."""
        head = self.scheduler.waiting[0]
        need = self.scheduler.blocks_to_admit(head)
        if need > self.num_blocks:
            self._fail_request(head, PoolExhausted(
                grpc.StatusCode.RESOURCE_EXHAUSTED, f"request {head.request_id} needs {need} "
                f"blocks; the pool has {self.num_blocks}"))
            return
        await asyncio.sleep(ROOM_POLL_S)
        self._free_blocks = (await self.session.stats()).free_blocks

    async def _preempt(self, plan: Plan) -> None:
        ids = self.scheduler.preempt_ids(plan)
        outputs = await self.link.step([], [], ids)
        self._free_blocks = outputs.free_blocks
        self.scheduler.preempted(plan)

    async def _exhausted(self, plan: Plan, times: int) -> None:
        """The pool was fuller than the runner's last answer said (another client took blocks,
        or a step needed more than planned): nothing changed. Read the free blocks back and plan
        again. The second time in a row, preempt the newest request, even one running alone, or
        with nothing running let the oldest waiting request wait: other clients' blocks come
        back, and one that could never fit the pool fails (`_wait_for_room`)."""
        self.scheduler.unadmit(plan)
        self._free_blocks = (await self.session.stats()).free_blocks
        if times < 2:
            return
        running = self.scheduler.running
        if running:
            await self._preempt(Plan(preempt=[running[-1]]))
        elif self.scheduler.waiting:
            await self._wait_for_room()

    def _fail(self, plan: Plan, exc: PagedKVError) -> None:
        """A step failed for a reason a retry would not cure: fail the requests it carried
        (those it admitted included)."""
        for request in dict.fromkeys([*plan.admit, *plan.owners]):
            self._fail_request(request, exc)

    def _fail_request(self, request: Request, exc: BaseException) -> None:
        self.scheduler.drop(request)
        queue = self._streams.get(request.request_id)
        if queue is not None:
            queue.put_nowait(exc)

    def _publish_finals(self, finals: list[Request]) -> None:
        for request in finals:
            self._publish(request)
        finals.clear()

    def _publish(self, request: Request) -> None:
        queue = self._streams.get(request.request_id)
        if queue is not None:
            queue.put_nowait(request.output())

    def _observe(self, plan: Plan, free_blocks: int, schedule_s: float, sampled: int) -> None:
        self.num_steps += 1
        running = self.scheduler.num_running_seqs
        self.peak_running_seqs = max(self.peak_running_seqs, running)
        record = StepRecord(time.monotonic() - self._started, len(plan.steps),
                            sum(len(s.token_ids) for s in plan.steps), sampled, running,
                            len(self.scheduler.waiting), free_blocks, schedule_s)
        for observer in self.observers:
            observer(record)

    # ------------------------------------------------------------------ closing

    async def close(self) -> None:
        """Stop the loop, fail what is still pending, release the sequences through the runner,
        close the session and channels."""
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        for queue in self._streams.values():
            queue.put_nowait(asyncio.CancelledError("the engine was closed"))
        await self._release_all()
        await self.runner.close()
        await self.pool.close()  # closes the session: the daemon frees its sequences

    async def _release_all(self) -> None:
        """Free every sequence the engine may hold with a release-only runner step: the runner
        answers it only after any forward it still runs for this session (a step cancelled by
        close, a step decoded ahead), so closing the session never frees blocks under it (and
        its release ends the runner's hold: the daemon does not refuse the close).
        Sequences that do not exist (an admission whose step was cancelled) are ignored."""
        held = {seq.seq_id for request in self.scheduler.running for seq in request.seqs}
        held.update(self.scheduler.to_release)
        if self._in_flight is not None:
            held.update(seq.seq_id for seq in self._in_flight.seqs)
        if held:
            with contextlib.suppress(PagedKVError, TimeoutError):
                await asyncio.wait_for(self.runner.step(self.session, [], sorted(held)),
                                       CLOSE_RELEASE_S)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()
