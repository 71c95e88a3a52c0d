"""The client's engine: requests in, one runner step per iteration, outputs out.

    daemon = "unix:///run/pagedkv/pagedkvd.sock"
    runner = "unix:///run/pagedkv-runner/pagedkv-runner.sock"
    async with await Engine.connect(daemon=daemon, runner=runner) as engine:
        out = await engine.generate([1, 2, 3], SamplingParams(temperature=0, max_tokens=8))
        async for partial in engine.stream([1, 2, 3], SamplingParams(max_tokens=8)):
            print(partial.outputs[0].token_ids)          # every token so far
        async for new in engine.stream([1, 2, 3], SamplingParams(max_tokens=8), delta=True):
            print(new.outputs[0].token_ids)              # the step's new tokens

One engine is one client of the pool: its own daemon session (a lease kept alive in the
background, so a dying client's blocks come back within its lease) and a runner that computes
for it. A background task loops: plan a step (`Scheduler`), send it to the runner (one message
on the session's Runner.StepStream), hand the answers back, and push each request's progress to
its waiter (`stream`: an output per step, of every token so far or, with `delta`, of the
step's new ones; `generate`: the final one only). Each step goes with
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
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import replace
from types import TracebackType
from typing import Self

import grpc

from pagedkv.client.engine.fair_queue import Line
from pagedkv.client.engine.follow import Following, next_push
from pagedkv.client.engine.outputs import RequestOutput, StepRecord
from pagedkv.client.engine.requests import Request, request_seed
from pagedkv.client.engine.runner_link import RESTART_WAIT_S, RunnerLink
from pagedkv.client.engine.scheduler import Plan, Scheduler, SchedulerConfig
from pagedkv.client.engine.swap_rule import HostTier
from pagedkv.client.engine.waiters import OutputKind, Waiters
from pagedkv.client.pool.client import DEFAULT_RETRY, PoolClient
from pagedkv.client.pool.errors import (
    DaemonUnavailable,
    OutcomeUnknown,
    PagedKVError,
    PoolExhausted,
    RunnerUnavailable,
    StalePlan,
    UnknownSequence,
)
from pagedkv.client.pool.recovery import RetryPolicy
from pagedkv.client.pool.runner_client import RunnerClient, RunnerInfo
from pagedkv.client.pool.sampling_params import SamplingParams
from pagedkv.client.pool.session import Session
from pagedkv.client.pool.step_outputs import StepOutputs
from pagedkv.client.pool.types import ModelInfo, PoolInfo
from pagedkv.vocab.request_ids import check_request_id, plausible
from pagedkv.vocab.token_ids import check_vocabulary

# How often an idle engine whose next request does not fit reads the pool's free blocks again.
ROOM_POLL_S = 0.05
# How long close waits for the runner to release the engine's sequences (its forwards first).
CLOSE_RELEASE_S = 10.0


class Engine:
    """Continuous batching over one daemon session and one runner."""

    def __init__(self, pool: PoolClient, session: Session, runner: RunnerClient, *,
                 vocab_size: int, eos_token_ids: Sequence[int], num_blocks: int,
                 free_blocks: int, config: SchedulerConfig, reservation_blocks: int = 0,
                 max_model_len: int = 0, runner_id: str = "",
                 runner_restart_wait_s: float = RESTART_WAIT_S,
                 host_tier: HostTier | None = None, waiting: Line | None = None,
                 pool_id: str = "") -> None:
        self.pool = pool
        self.session = session
        self.runner = runner
        # The daemon's pool the session was opened on (PoolInfo.pool_id): a restarted daemon
        # that restored it names it as its previous_pool_id.
        self.pool_id = pool_id
        # The runner's steps, carried across its restarts (runner_id: RunnerInfo's; a step
        # that got no answer waits up to runner_restart_wait_s for a restarted runner).
        self.link = RunnerLink(runner, session, runner_id, restart_wait_s=runner_restart_wait_s)
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        # The most tokens a sequence may hold (SchedulerConfig.max_model_len, else the runner's
        # RunnerInfo.max_model_len; 0 = none).
        self.max_model_len = max_model_len
        # SchedulerConfig.seed, and the number of the next request that brings no seed.
        self._seed = config.seed
        self._unseeded = itertools.count()
        # host_tier: the daemon's host-memory tier as it serves this session's model (none:
        # no tier), for the scheduler's swap-or-recompute rule; waiting: the line its requests
        # wait in (fair_queue.py; engines sharing a queue take turns by key).
        self.scheduler = Scheduler(config, session.block_size, num_blocks, reservation_blocks,
                                   host_tier, waiting)
        self.num_blocks = num_blocks
        # Called with each step's record (from the engine's task).
        self.observers: list[Callable[[StepRecord], None]] = []
        self.num_steps = 0
        self.peak_running_seqs = 0
        self._free_blocks = free_blocks
        self._seq_ids = itertools.count()
        self._request_ids = itertools.count()
        self.waiters = Waiters()
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
        # Steps the runner took by itself and pushed (applied here), however many a push carried.
        self.num_pushed = 0
        # Steps refused in a row as PoolExhausted, and as StalePlan.
        self._exhausted = self._stale = 0
        self._started = time.monotonic()
        self._task = asyncio.create_task(self._loop(), name="pagedkv-engine")

    @classmethod
    async def connect(cls, daemon: str, runner: str | None = None, *, model: str = "",
                      config: SchedulerConfig | None = None, client_name: str = "engine",
                      auth_token: str | None = None, cache_salt: bytes | str = b"",
                      lease_ttl_ms: int = 0,
                      runner_restart_wait_s: float = RESTART_WAIT_S,
                      waiting: Line | None = None,
                      pool_retry: RetryPolicy | None = DEFAULT_RETRY) -> Self:
        """Open a session on the daemon and a channel to the runner computing on its pool: the
        runner at `runner`, else the one serving `model` (as it registered with the daemon;
        ValueError naming the models served when none serves it). The session holds the
        runner's model's K/V (RunnerInfo.model_name), so a client of a runner always steps
        its model. `runner_restart_wait_s`: how long a step that got no answer waits for a
        restarted runner (0 when nothing restarts it) before its requests fail. `waiting`: a
        line of a queue shared with other engines (fair_queue.py), else one of its own.
        `pool_retry`: how its daemon calls whose answer was lost are recovered (its
        `outage_s` lets them wait out a restored daemon restart)."""
        pool = await PoolClient.connect(daemon, auth_token=auth_token, retry=pool_retry)
        runner_client: RunnerClient | None = None
        try:
            pool_info = await pool.pool_info()
            if runner is None:
                if not model:
                    raise ValueError("give the runner's target or the model's name")
                runner = pool_info.runner_for(model)
            # Its steps go on one Runner.StepStream (a message costs a third of a Step call).
            runner_client = await RunnerClient.connect(runner, stream_steps=True)
            info = await runner_client.info()
            _check_runner(info, pool_info.pool_id, model, runner, daemon)
            config = config or SchedulerConfig()
            max_model_len = _max_model_len(config, info)
            session = await pool.open_session(client_name, lease_ttl_ms, cache_salt=cache_salt,
                                              model=info.model_name)
            stats = await session.stats()
        except BaseException:
            if runner_client is not None:
                await runner_client.close()
            await pool.close()
            raise
        return cls(pool, session, runner_client, vocab_size=info.vocab_size,
                   eos_token_ids=info.eos_token_ids, num_blocks=stats.num_blocks,
                   free_blocks=stats.free_blocks, config=config,
                   reservation_blocks=pool_info.reservation_blocks,
                   max_model_len=max_model_len, runner_id=info.runner_id,
                   runner_restart_wait_s=runner_restart_wait_s,
                   host_tier=_host_tier(pool_info, info.model_name), waiting=waiting,
                   pool_id=pool_info.pool_id)

    def failure(self) -> str | None:
        """Why the engine no longer steps (its loop ended: a lost daemon, a bug, closed), or
        None while it runs."""
        if not self._task.done():
            return None
        if self._task.cancelled() or self._task.exception() is None:
            return "the engine is closed"
        return f"the engine stopped: {self._task.exception()!r}"

    async def kv_usage(self) -> float:
        """The share of the pool's blocks in use now (1 = full), read from the daemon: one
        GetStats. Not the free blocks of the latest answer, which stay as they were while the
        runner steps into reserved slots (no daemon call), while this engine is idle, and while
        other sessions take and free blocks."""
        stats = await self.pool.stats()
        return 1.0 - stats.free_blocks / stats.num_blocks if stats.num_blocks else 0.0

    # ------------------------------------------------------------------ requests

    async def generate(self, prompt_token_ids: Sequence[int],
                       params: SamplingParams | None = None,
                       request_id: str | None = None, key: str = "", *,
                       client_request_id: str = "") -> RequestOutput:
        """Generate to the end; the final output. `key`: whose request it is (waiting
        requests take turns by key: fair_queue.py). `client_request_id`: the id of the client's
        request it serves, which the runner and the daemon log (`_request`)."""
        final = None
        async for output in self._outputs(prompt_token_ids, params, request_id, "final", key,
                                          client_request_id):
            final = output
        assert final is not None and final.finished
        return final

    def stream(self, prompt_token_ids: Sequence[int], params: SamplingParams | None = None,
               request_id: str | None = None, key: str = "", *,
               client_request_id: str = "", delta: bool = False
               ) -> AsyncGenerator[RequestOutput]:
        """The request's output after each step that changed it: every token so far, or with
        `delta` only the tokens (and logprobs) new since the previous output (vLLM's
        RequestOutputKind.DELTA: the server's streams; ValueError for beam search and best_of
        > n, which choose their outputs at the end). The last one is finished. Closing it
        (`aclose`) before the end aborts the request and frees its blocks."""
        return self._outputs(prompt_token_ids, params, request_id,
                             "delta" if delta else "cumulative", key, client_request_id)

    async def _outputs(self, prompt_token_ids: Sequence[int], params: SamplingParams | None,
                       request_id: str | None, kind: OutputKind, key: str,
                       client_request_id: str) -> AsyncGenerator[RequestOutput]:
        """The request's outputs of `kind` (waiters.py): after each step that changed it, or
        only the final one (an output per step costs the engine's loop a copy of the tokens
        it shows)."""
        params = params or SamplingParams()
        if kind == "delta" and (params.beam_width or params.num_samples > params.n):
            raise ValueError("delta outputs need plain or parallel sampling: beam search and "
                             "best_of > n choose their outputs at the end")
        request = self._request(prompt_token_ids, params, request_id, key, client_request_id)
        queue = self.waiters.open(request.request_id, kind)
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
            self.waiters.close(request.request_id)
            if not request.finished:
                self.scheduler.abort(request)
                self._wake.set()

    def _request(self, prompt: Sequence[int], params: SamplingParams, request_id: str | None,
                 key: str, client_request_id: str) -> Request:
        """A new request, named `request_id` (unique among the running ones) or
        `req-N`; ValueError, nothing changed, for a bad prompt or id. The runner and the daemon
        log `client_request_id` with its sequences, else its name when that is an id
        (pagedkv.vocab.request_ids): many requests may share a client's id (the prompts of one
        HTTP request), the engine's names stay unique."""
        if (problem := check_request_id(client_request_id, "client_request_id")) is not None:
            raise ValueError(problem)
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
        if name in self.waiters:
            raise ValueError(f"request id {name!r} is already running")
        return Request(name, prompt, self._with_defaults(params, len(prompt)),
                       lambda: next(self._seq_ids), self.eos_token_ids, key,
                       client_request_id or (name if plausible(name) else ""))

    def _with_defaults(self, params: SamplingParams, prompt_len: int) -> SamplingParams:
        """`params` with the engine's seed when it brings none, and at most the tokens the
        prompt leaves under max_model_len (the last one sampled at the last position, as the
        runner finishes a sequence that fills the model's positions)."""
        if params.seed is None and self._seed is not None:
            params = replace(params, seed=request_seed(self._seed, next(self._unseeded)))
        room = self.max_model_len - prompt_len + 1
        if self.max_model_len and params.max_tokens > room:
            params = replace(params, max_tokens=room, min_tokens=min(params.min_tokens, room))
        return params

    # ------------------------------------------------------------------ the loop

    async def _loop(self) -> None:
        try:
            await self._steps()
        except Exception as exc:  # a bug or a lost daemon: no waiter may hang
            self.waiters.fail_all(exc)
            raise
        finally:  # its requests no longer wait: they must not hold a shared queue's turns
            self.scheduler.waiting.clear()

    async def _steps(self) -> None:
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
            planned = time.monotonic() - began
            outputs = None
            if plan.preempt:
                await self._preempt(plan)
            elif not plan.steps and not plan.release:
                await self._wait_for_room()
            else:
                outputs = await self._send(plan)
            if outputs is None:  # nothing stepped: the finished requests wait for a release
                self._finals = finals
                continue
            self._publish_finals(finals)
            self._answered(plan, outputs, planned)

    async def _send(self, plan: Plan) -> StepOutputs | None:
        """Send `plan`: its answers, or None if it failed (handled here: see runner.proto's
        retry rules and `Following`)."""
        # The runner may have stepped the followed sequences past the pushes read here: a lost
        # answer is then not resent with histories but computed again (`_recompute`).
        unseen = bool(self.following.implied.seqs)
        try:
            self._in_flight = plan
            sent = time.monotonic()
            outputs = await self.link.step(plan.seqs, plan.steps, plan.release,
                                           follow=self._follow, resend=not unseen)
            self._in_flight = None
            self._measure(plan, outputs, time.monotonic() - sent)
        except OutcomeUnknown as exc:
            if unseen:
                await self._recompute(plan)
            else:
                self._fail(plan, exc)
            return None
        except StalePlan as exc:  # planned before pushes not read yet: read them, plan again
            self._stale += 1
            if self._stale > 1:  # the runner stopped following at the first: never twice
                self._fail(plan, exc)
            else:
                self.scheduler.unadmit(plan)
            return None
        except PoolExhausted:
            self._exhausted += 1
            await self._short_of_blocks(plan)
            return None
        except PagedKVError as exc:
            self._fail(plan, exc)
            return None
        self._exhausted = self._stale = 0
        self.following.answered(plan, outputs, self._follow)
        return outputs

    def _measure(self, plan: Plan, outputs: StepOutputs, seconds: float) -> None:
        """Feed the swap rule's prefill rate with a step the engine sent (before its answer
        is applied: the sequences still say what was computed before it)."""
        computed = sum(seq.newly_computed(out)
                       for seq, out in zip(plan.seqs, outputs, strict=True))
        self.scheduler.swap.prefill.observe(computed, seconds)

    def _answered(self, plan: Plan, outputs: StepOutputs, planned: float) -> None:
        """Apply the answer to `plan` (a step the engine sent, or one the runner took by itself
        and pushed) and publish what progressed; `planned`: seconds spent planning it."""
        began = time.monotonic()
        self._free_blocks = outputs.free_blocks
        progressed = self.scheduler.update(plan, outputs)
        for request in progressed:
            if request.finished:
                self._finals.append(request)
            else:
                self.waiters.progressed(request)
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
            pushed = (await next_push(self.runner, self.session, self._wake) if wait
                      else self.runner.take_push(self.session))
        except (PoolExhausted, RunnerUnavailable):  # nothing changed: the engine's own step
            self.following.stop()                    # meets it next (and waits the runner out)
            return False
        except (DaemonUnavailable, UnknownSequence):
            # The runner forgot the session's sequences (its own step met its daemon gone, or
            # the daemon came back from its crash log) and stepped no further than this push:
            # the engine's next step resends histories.
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
        for step in pushed.steps():  # a lagging stream's push carries several, in order
            self.num_pushed += 1
            plan, outputs = self.following.pushed(step)
            self._answered(plan, StepOutputs(outputs, step.free_blocks), 0.0)
        return True

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
        """Nothing runs and the next waiting request does not fit now (other clients hold the
        pool), or it is another engine's turn (a shared queue). Fail it if it could never fit;
        else read the free blocks again shortly."""
        head = self.scheduler.waiting.head()
        need = self.scheduler.blocks_to_admit(head) if head is not None else 0
        if head is not None and need > self.num_blocks:
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

    async def _short_of_blocks(self, plan: Plan) -> None:
        """The pool was fuller than the runner's last answer said (another client took blocks,
        or a step needed more than planned): nothing changed. Read the free blocks back and plan
        again. The second time in a row, preempt the newest request, even one running alone, or
        with nothing running let the oldest waiting request wait: other clients' blocks come
        back, and one that could never fit the pool fails (`_wait_for_room`)."""
        self.scheduler.unadmit(plan)
        self._free_blocks = (await self.session.stats()).free_blocks
        if self._exhausted < 2:
            return
        running = self.scheduler.running
        if running:
            await self._preempt(Plan(preempt=[running[-1]]))
        elif self.scheduler.waiting:
            await self._wait_for_room()

    def _fail(self, plan: Plan, exc: PagedKVError) -> None:
        """A step failed for a reason a retry would not cure: fail the requests it carried
        (those it admitted included), and send its releases no more (the same release would
        fail again, and the finished requests waiting on it would never be published)."""
        self.scheduler.release_sent(plan)
        for request in dict.fromkeys([*plan.admit, *plan.owners]):
            self._fail_request(request, exc)

    def _fail_request(self, request: Request, exc: BaseException) -> None:
        self.scheduler.drop(request)
        self.waiters.fail(request.request_id, exc)

    def _publish_finals(self, finals: list[Request]) -> None:
        for request in finals:
            self.waiters.publish(request)
        finals.clear()

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
        self.waiters.fail_all(asyncio.CancelledError("the engine was closed"))
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


def _max_model_len(config: SchedulerConfig, info: RunnerInfo) -> int:
    """The engine's max_model_len: the config's, at most the model's positions; else the
    model's."""
    if info.max_model_len and config.max_model_len > info.max_model_len:
        raise ValueError(f"max_model_len {config.max_model_len} exceeds the {info.max_model_len} "
                         f"positions of the runner's model {info.model_name!r}")
    return config.max_model_len or info.max_model_len


def _host_tier(pool_info: PoolInfo, model: str) -> HostTier:
    """The daemon's host tier as it serves `model`: it holds copies of the blocks of the daemon's
    own format (kvpool.proto), whichever model of that geometry left them, so for a model of
    another geometry there is none."""
    own, mine = pool_info.model_info(pool_info.model), pool_info.model_info(model)
    if model != pool_info.model and (own is None or mine is None or _shape(own) != _shape(mine)):
        return HostTier()
    return HostTier.from_pool_info(pool_info)


def _shape(model: ModelInfo) -> tuple[int, int, int, str]:
    """What makes models share a format (the daemon's KvShape)."""
    return model.num_layers, model.num_kv_heads, model.head_dim, model.dtype


def _check_runner(info: RunnerInfo, pool_id: str, model: str, runner: str, daemon: str) -> None:
    """ValueError unless the runner computes on the daemon's pool, and serves `model` if one
    is named."""
    if info.pool_id != pool_id:
        raise ValueError(f"the runner at {runner} computes on pool {info.pool_id}, not on the "
                         f"pool of the daemon at {daemon} ({pool_id})")
    if model and info.model_name != model:
        raise ValueError(f"the runner at {runner} serves model {info.model_name!r}, not "
                         f"{model!r}")
