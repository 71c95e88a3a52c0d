"""How a client's step fails at the runner: the three ways it is refused before anything
changes (malformed, an unknown sequence, planned before the runner's pushes on a stream), and
the one way it fails after its daemon calls were applied. The step itself travels in the
client's own records, on both sides of the wire: a SeqStep per sequence asked for (a History when
resent after a runner restart), a SeqOutput per sequence answered, in a StepOutputs; and the step
the runner takes itself (`implied_step`)."""

from collections.abc import Sequence

from pagedkv.client import SeqOutput, SeqStep


class InvalidStep(ValueError):
    """A client's step is malformed (mapped to INVALID_ARGUMENT); nothing was changed."""


class UnknownSequence(RuntimeError):
    """An existing sequence the runner has never seen and cannot read back, or whose sampling
    it does not keep: the client must resend it with its history and sampling
    (FAILED_PRECONDITION); nothing was changed."""


class Unsupported(RuntimeError):
    """The runner cannot do what the step asks (structured outputs on a model without a
    tokenizer): FAILED_PRECONDITION, cause "Unsupported"; nothing was changed."""


class StepNotComputed(RuntimeError):
    """A client's step failed after its daemon calls were applied (its forward failed): its
    sequences hold the step's tokens, in the daemon and in the runner, not computed (ABORTED,
    cause "StepNotComputed"). Resend the step without token_ids, every sequence as an existing
    one, to compute them; or release them. Never resend it as it was: it would append twice."""



class StalePlan(RuntimeError):
    """A stream step naming sequences was planned before answers the runner has pushed while it
    followed the session (runner.proto's StepStream, "Following"): the client holds less than
    the runner does (ABORTED, cause "StalePlan"); nothing was changed. Read the pushes, plan
    again."""


def implied_step(requests: Sequence[SeqStep], results: Sequence[SeqOutput],
                 release: Sequence[int]) -> list[SeqStep]:
    """The client's next step of the sequences it marked decode_ahead whose token this step
    sampled and that go on (runner.proto's "implied step"): append that token, with the
    sampling the request carries (the kept one, once the step filled it in), decode_ahead
    again, nothing released. What the runner computes ahead, and the step it takes itself while
    it follows a session (model_runner/process/follow.py)."""
    released = set(release)
    return [SeqStep(r.seq_id, (result.token_id,), params=r.params, decode_ahead=True)
            for r, result in zip(requests, results, strict=True)
            if r.decode_ahead and result.sampled and not result.finished
            and r.seq_id not in released]
