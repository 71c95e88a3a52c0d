"""A stand-in engine for the server's tests, without processes: its request yields one step of one
token, then fails as an engine does when its runner is gone."""

from collections.abc import AsyncGenerator
from types import SimpleNamespace

from pagedkv.client.engine.outputs import CompletionOutput, RequestOutput
from pagedkv.client.pool.sampling_params import SamplingParams


class FailingEngine:
    """One step of one token, then the failure an engine raises when its runner is gone."""

    vocab_size = 100
    max_model_len = 64
    scheduler = SimpleNamespace(waiting=[], running=[])

    async def stream(self, prompt_ids: list[int], params: SamplingParams, key: str = "",
                     client_request_id: str | None = None,
                     delta: bool = False) -> AsyncGenerator[RequestOutput]:
        yield RequestOutput("req-0", tuple(prompt_ids),
                            [CompletionOutput(0, (5,), 0.0, None, None, None)], False,
                            len(prompt_ids), 0, 1)
        raise RuntimeError("the runner is gone")
