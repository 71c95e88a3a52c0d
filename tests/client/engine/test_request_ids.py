"""The engine's request ids on the wire, with a scripted runner that records every SeqStep: a
sequence's first step carries the client's id (a parallel sample's fork too), later steps none
(the runner keeps it); requests may share a client's id while the engine's names stay unique;
with no client id the engine's own name travels; a bad one is refused before anything runs."""

import asyncio
from collections.abc import Sequence

import pytest

from pagedkv.client import SamplingParams, SeqStep, StepOutputs

from scripted_engine import ScriptedRunner, engine

GREEDY = SamplingParams(temperature=0.0, max_tokens=3)


class RecordingRunner(ScriptedRunner):
    """The scripted runner, keeping each step's sequences."""

    def __init__(self) -> None:
        super().__init__(full=set())
        self.sent: list[SeqStep] = []

    async def step(self, session: object, seqs: Sequence[SeqStep],
                   release: Sequence[int] = (), *, follow: bool = False) -> StepOutputs:
        self.sent.extend(seqs)
        return await super().step(session, seqs, release, follow=follow)


async def test_first_steps_carry_the_client_id_forks_included() -> None:
    runner = RecordingRunner()
    generating = engine(runner)
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=3, n=2)
    output = await generating.generate([1, 2, 3], params, client_request_id="abc-123")
    await generating.close()
    assert output.request_id == "req-0"  # the engine's own name
    firsts = [seq for seq in runner.sent if seq.new_sequence]
    assert len(firsts) == 2 and firsts[1].parent_seq_id == firsts[0].seq_id
    assert {seq.request_id for seq in firsts} == {"abc-123"}
    assert {seq.request_id for seq in runner.sent if not seq.new_sequence} == {""}


async def test_requests_share_a_client_id_and_the_default_is_the_engine_name() -> None:
    runner = RecordingRunner()
    generating = engine(runner)
    shared = await asyncio.gather(*(generating.generate([i + 1, 2], GREEDY,
                                                        client_request_id="batch-7")
                                    for i in range(2)))
    named = await generating.generate([4, 5], GREEDY, request_id="job 17")  # not an id
    plain = await generating.generate([6, 7], GREEDY)
    await generating.close()
    assert len({output.request_id for output in shared}) == 2
    firsts = [seq.request_id for seq in runner.sent if seq.new_sequence]
    assert firsts == ["batch-7", "batch-7", "", plain.request_id]
    assert named.request_id == "job 17"


@pytest.mark.parametrize("bad", ["x" * 129, "a\nb"])
async def test_a_bad_client_id_is_refused_before_anything_runs(bad: str) -> None:
    runner = RecordingRunner()
    generating = engine(runner)
    with pytest.raises(ValueError, match="client_request_id must be 1 to 128"):
        await generating.generate([1, 2], GREEDY, client_request_id=bad)
    await generating.close()
    assert runner.sent == [] and not generating.scheduler.has_work
