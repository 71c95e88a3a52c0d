"""A model's registration, its sleep and its wake (kvpool.proto, "Models and pages").

The pool serves several models: each session names one, and its calls run in that model's
format (`formats.py`: one block pool per geometry over the pages it holds, pages moved between
formats when a call does not fit; per-model caps). Pool keys stay (session number, seq_id) in
the format's pool. Runners register their models (`register`, idempotent for the same
geometry). A model's sleep closes its sessions, as an expiry does (`session_life.py`), and
drops its cached blocks, under the pool's lock (`call_path.py`); it is refused while a runner
holds one of its sessions, and new sessions of a sleeping model are refused until it is woken.
"""

from pagedkv.daemon.service.call_path import CallPath
from pagedkv.daemon.service.errors import SessionBusy
from pagedkv.daemon.service.holds import busy_reason
from pagedkv.daemon.service.memory_order import MemoryWork
from pagedkv.daemon.service.models import KvShape, Model
from pagedkv.daemon.service.session_life import SessionLife
from pagedkv.daemon.service.sessions import Session
from pagedkv.process.log_setup import get_logger

log = get_logger(__name__)


class ModelOps:
    """Register, sleep and wake the pool's models, on the service's call path."""

    def __init__(self, calls: CallPath, life: SessionLife) -> None:
        self._calls = calls
        self._life = life

    def register(self, name: str, shape: KvShape, runner_target: str = "") -> Model:
        """Register a runner's model (models.py: idempotent for the same geometry). A new
        geometry needs a paged pool and, with memory, per-format views of it."""
        model = self._calls.formats.register(name, shape, runner_target)
        log.info("model registered", model=name, format=model.format.shape.label,
                 runner_target=runner_target)
        return model

    async def set_state(self, name: str, asleep: bool) -> Model:
        """Wake a model, or put it to sleep: refused (SessionBusy) while a runner holds one of
        its sessions, else its sessions are closed (their sequences freed, as an expiry does;
        their clients then get NOT_FOUND), its cached blocks dropped, and new sessions of it
        refused until it is woken. Answered once the memory work (zeroing) is done."""
        calls = self._calls
        model = calls.formats.models.get(name)
        if not asleep:
            model.asleep = False
            calls.note(lambda: ["model_state", name, False])
            log.info("model woken", model=model.name)
            return model
        async with calls.lock:
            calls.memory_order.check()
            mine = [s for s in calls.sessions if s.model == model.name]
            self._check_unheld(model, mine)
            pending = [self._life.drop(session, expired=False)[1] for session in mine]
            fmt, work = model.format, MemoryWork()
            dropped = fmt.hygiene.drop(fmt.hygiene.cached.blocks_of(model.number), work)
            if fmt.hygiene.host is not None:  # its host copies go with its cached blocks
                fmt.hygiene.host.model_asleep(model.number, work, fmt.hygiene.events)
            pending.append(calls.start_work(fmt, work, tuple))
            model.asleep = True
            calls.note(lambda: ["model_state", name, True])
        for done in pending:
            await done.wait()
        log.info("model asleep", model=model.name, closed_sessions=len(mine),
                 dropped_cached_blocks=len(dropped))
        return model

    def _check_unheld(self, model: Model, sessions: list[Session]) -> None:
        """SessionBusy if a runner holds one of the model's `sessions` now."""
        now = self._calls.sessions.now()
        for session in sessions:
            if session.held(now, f"model {model.name!r}'s sleep"):
                raise SessionBusy(f"SetModelState refused (model {model.name!r}): "
                                  f"{busy_reason(session, now)}; stop its runner's steps, "
                                  "then retry")
