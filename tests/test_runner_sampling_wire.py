"""The runner's reading of SamplingParams from the wire (servicer.sampling_params): proto3
zeros mean "off" (logprobs -1 is none, 0 the sampled token's only); the same message read again
is the remembered validated object; an invalid or long message is never remembered."""

import pytest

from pagedkv.client import SamplingParams
from pagedkv.model_runner.process import servicer
from pagedkv.model_runner.process.servicer import NO_LIMIT, PARAMS_CACHE_BYTES, sampling_params
from pagedkv.proto import runner_pb2 as rpb


@pytest.mark.parametrize(("message", "expected"), [
    (rpb.SamplingParams(), SamplingParams(temperature=0.0, logprobs=0, max_tokens=NO_LIMIT)),
    (rpb.SamplingParams(temperature=0.75, top_k=5, top_p=0.5, min_p=0.125, seed=3, has_seed=True,
                        logprobs=2, stop_token_ids=[4, 5], max_tokens=9,
                        repetition_penalty=1.25),
     SamplingParams(temperature=0.75, top_k=5, top_p=0.5, min_p=0.125, seed=3, logprobs=2,
                    stop_token_ids=(4, 5), max_tokens=9, repetition_penalty=1.25)),
    (rpb.SamplingParams(temperature=1.0, top_p=0.0, logprobs=-1, max_tokens=1),
     SamplingParams(temperature=1.0, top_p=1.0, logprobs=None, max_tokens=1)),
])
def test_wire_values_become_sampling_params(message, expected):
    got = sampling_params(message)
    assert got == expected
    # the same bytes again: the remembered object, not a second validation
    assert sampling_params(rpb.SamplingParams.FromString(message.SerializeToString())) is got


def test_an_invalid_message_raises_every_time():
    bad = rpb.SamplingParams(temperature=-1.0, max_tokens=4)
    for _ in range(2):
        with pytest.raises(ValueError, match="temperature must be >= 0"):
            sampling_params(bad)


def test_a_long_message_is_read_but_not_remembered():
    stops = list(range(1000, 1000 + PARAMS_CACHE_BYTES))
    message = rpb.SamplingParams(temperature=0.0, stop_token_ids=stops, max_tokens=4)
    assert len(message.SerializeToString()) > PARAMS_CACHE_BYTES
    before = servicer._cached_sampling_params.cache_info().currsize
    first, second = sampling_params(message), sampling_params(message)
    assert first == second and first is not second
    assert first.stop_token_ids == tuple(stops)
    assert servicer._cached_sampling_params.cache_info().currsize == before
