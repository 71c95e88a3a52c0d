"""The offline API (`pagedkv.llm.LLM`) and `pagedkv generate`, with real processes: a daemon and a
runner started by the LLM, on a real transformers model saved to a folder with a real tokenizer
(byte-level BPE trained here on a few sentences, saved as a PreTrainedTokenizerFast), against
transformers' own generate on the same weights. Nothing is downloaded. The model folder is
tests/support/chat_model.py's `make_model_dir`: its eos `<eos>` (id 0) ends EOS_PROMPT after a
few tokens.
"""

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from pagedkv.client import PoolClient, RunnerUnreachable
from pagedkv.client.engine.runner_link import RESTART_WAIT_S
from pagedkv.llm import LLM, SamplingParams
from pagedkv.llm.pool_budget import CPU_KV_CAP, embedded_budget
from pagedkv.llm.progress import Progress
from pagedkv.vocab.pool_sizing import DeviceMemory

from chat_model import EOS_PROMPT, hf_generate
from pagedkvd_process import short_tmp_dir

PROMPTS = ["the cat sat on", "hello world"]
GREEDY = SamplingParams(temperature=0, max_tokens=8)
GiB = 2**30


@pytest.fixture(scope="module")
def llm(model_dir: Path) -> Iterator[LLM]:
    """The LLM under test: its own daemon (a 4 MiB pool, a 2 MiB host tier) and runner."""
    with LLM(model=str(model_dir), kv_cache_memory="4MiB", max_num_seqs=8,
             host_tier_memory="2MiB") as started:
        yield started


def test_greedy_text_and_tokens_equal_transformers(
        llm: LLM, reference: PreTrainedModel, tokenizer: PreTrainedTokenizerFast) -> None:
    outputs = llm.generate([*PROMPTS, EOS_PROMPT], GREEDY)
    assert [out.prompt for out in outputs] == [*PROMPTS, EOS_PROMPT]
    for prompt, out in zip([*PROMPTS, EOS_PROMPT], outputs, strict=True):
        ids = tokenizer.encode(prompt)
        assert list(out.prompt_token_ids) == ids
        [completion] = out.outputs
        assert [list(completion.token_ids)] == hf_generate(reference, ids, max_new_tokens=8,
                                                           do_sample=False)
        assert completion.text == tokenizer.decode(completion.token_ids,
                                                   skip_special_tokens=True)
    # The model's end-of-sequence id (the runner reports it) is the tokenizer's <eos>: it
    # ends the request, and the text leaves it out.
    stopped = outputs[-1].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.token_ids[-1] == 0
    assert "<eos>" not in stopped.text
    assert outputs[0].outputs[0].finish_reason == "length"


def test_ignore_eos_generates_past_the_eos_to_max_tokens(llm: LLM) -> None:
    [ignored] = llm.generate(EOS_PROMPT, SamplingParams(temperature=0, max_tokens=8,
                                                        ignore_eos=True))
    [completion] = ignored.outputs
    assert completion.finish_reason == "length" and len(completion.token_ids) == 8
    assert 0 in completion.token_ids[:-1]  # the <eos> that would have ended it


def test_token_id_prompts_and_one_params_per_prompt(llm: LLM,
                                                    tokenizer: PreTrainedTokenizerFast) -> None:
    ids = tokenizer.encode(PROMPTS[0])
    [by_text] = llm.generate(PROMPTS[0], GREEDY)
    [by_ids] = llm.generate(ids, GREEDY)
    assert by_ids.prompt is None and by_ids.outputs[0].token_ids == by_text.outputs[0].token_ids
    short, long = llm.generate([ids, PROMPTS[1]], [SamplingParams(temperature=0, max_tokens=2),
                                                   SamplingParams(temperature=0, max_tokens=5)])
    assert len(short.outputs[0].token_ids) == 2 and len(long.outputs[0].token_ids) == 5


def test_parallel_samples_and_beam_search(llm: LLM, reference: PreTrainedModel,
                                          tokenizer: PreTrainedTokenizerFast) -> None:
    [sampled] = llm.generate(PROMPTS[0], SamplingParams(temperature=1.0, n=2, seed=7,
                                                        max_tokens=6))
    assert [c.index for c in sampled.outputs] == [0, 1]
    assert sampled.outputs[0].token_ids != sampled.outputs[1].token_ids
    for completion in sampled.outputs:
        assert completion.text == tokenizer.decode(completion.token_ids,
                                                   skip_special_tokens=True)
    [again] = llm.generate(PROMPTS[0], SamplingParams(temperature=1.0, n=2, seed=7,
                                                      max_tokens=6))
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in sampled.outputs]

    ids = tokenizer.encode(PROMPTS[1])
    [beams] = llm.generate(PROMPTS[1], SamplingParams(temperature=0, beam_width=2, n=2,
                                                      max_tokens=6))
    assert [list(c.token_ids) for c in beams.outputs] == hf_generate(
        reference, ids, num_beams=2, num_return_sequences=2, do_sample=False, max_new_tokens=6)
    assert [c.text for c in beams.outputs] == [
        tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in beams.outputs]


def test_an_llm_on_running_daemon_and_runner(llm: LLM, model_dir: Path) -> None:
    """A second LLM uses the first one's daemon and runner (its model folder for the
    tokenizer only); closing it leaves them running. It would wait for a restarted runner
    (someone else runs it), the first one would not (it started it)."""
    expected = llm.generate(PROMPTS, GREEDY)
    with LLM(model=str(model_dir), daemon=llm.daemon_target, runner=llm.runner_target) as other:
        assert other._engine.link.restart_wait_s == RESTART_WAIT_S
        assert llm._engine.link.restart_wait_s == 0.0
        assert [o.outputs[0].text for o in other.generate(PROMPTS, GREEDY)] == [
            o.outputs[0].text for o in expected]
    assert llm.generate(PROMPTS[0], GREEDY)[0].outputs[0].text == expected[0].outputs[0].text


@pytest.mark.parametrize(("prompts", "message"), [
    ([[]], "prompt 0 has no tokens"),
    ([[1, 2], [3, 300]], r"prompt 1: token ids must be in \[0, 300\)"),
    ([[1, -1]], r"token ids must be in \[0, 300\)"),
    (["fine", 3.5], "prompt 1 must be a str or a list of int token ids"),
    ([[1, True]], "prompt 0 must be a str or a list of int token ids"),
    ([""], "prompt 0 \\(''\\) encodes to no tokens"),
    ([[1], [1] * 513], "prompt 1 has 513 tokens; the model takes at most 512 positions"),
])
def test_bad_prompts_are_refused_before_anything_runs(llm: LLM, prompts: list[object],
                                                      message: str) -> None:
    with pytest.raises(ValueError, match=message):
        llm.generate(prompts, GREEDY)  # type: ignore[arg-type]


def test_a_failing_prompt_aborts_the_others(llm: LLM) -> None:
    """Beam search past the model's 512 positions fails its prompt when the engine takes it;
    the call raises that error and the other prompt, already queued, is aborted (no one waits
    for it; the engine frees it with its next step) instead of running on unseen."""
    beam_past_the_end = SamplingParams(temperature=0, beam_width=2, max_tokens=20)
    long_greedy = SamplingParams(temperature=0, max_tokens=400)
    with pytest.raises(ValueError, match="exceeds the model's 512 positions"):
        llm.generate([[5] * 10, [5] * 500], [long_greedy, beam_past_the_end])

    async def waited_for() -> list[str]:  # requests whose outputs someone still awaits
        return list(llm._engine.waiters)

    assert llm._loop.run(waited_for()) == []
    assert llm.generate([[5] * 10], GREEDY)[0].outputs[0].token_ids


def test_bad_arguments_are_refused(llm: LLM, model_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="2 sampling params for 1 prompts"):
        llm.generate(["a"], [GREEDY, GREEDY])
    with pytest.raises(ValueError, match="no model at '/nowhere/model': not a local directory "
                                         "nor a preset"):
        LLM("/nowhere/model")
    with pytest.raises(ValueError, match=r"has no config\.json"):
        LLM(str(tmp_path))
    with pytest.raises(ValueError, match=r"with daemon, give runner .* or model_name"):
        LLM(str(model_dir), daemon=llm.daemon_target)
    with pytest.raises(ValueError, match="give daemon too"):
        LLM(str(model_dir), model_name="other")
    with pytest.raises(ValueError, match="no tokenizer in"):
        LLM(str(model_dir), tokenizer=str(tmp_path), daemon=llm.daemon_target,
            runner=llm.runner_target)
    with pytest.raises(ValueError, match="unknown dtype"):
        LLM(str(model_dir), dtype="int3")
    with pytest.raises(ValueError, match="kv_cache_memory or num_blocks, not both"):
        LLM(str(model_dir), kv_cache_memory="1GiB", num_blocks=4)
    with pytest.raises(ValueError, match="host_tier_memory: not a byte size"):
        LLM(str(model_dir), host_tier_memory="lots")
    with pytest.raises(ValueError, match="host_tier_memory sets the daemon and runner LLM starts"):
        LLM(str(model_dir), host_tier_memory="1MiB", daemon=llm.daemon_target,
            runner=llm.runner_target)
    with pytest.raises(ValueError, match="swap must be one of auto, always, never"):
        LLM(str(model_dir), swap="sometimes")


async def _host_tier_blocks(daemon: str) -> tuple[int, int]:
    async with await PoolClient.connect(daemon) as client:
        info = await client.pool_info()
        return info.host_tier_blocks, info.bytes_per_block


def test_the_started_daemon_has_the_host_tier_asked_for(llm: LLM) -> None:
    blocks, per_block = asyncio.run(_host_tier_blocks(llm.daemon_target))
    assert blocks == (2 << 20) // per_block > 0


def test_the_cli_prints_completions(llm: LLM, model_dir: Path) -> None:
    """`pagedkv generate` on the LLM's daemon and runner: one block per prompt; stderr is not
    a terminal, so no progress bar."""
    expected = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=5))
    done = subprocess.run(
        [sys.executable, "-m", "pagedkv.cli", "generate", "--model", str(model_dir),
         "--daemon", llm.daemon_target, "--runner", llm.runner_target, "--temperature", "0",
         "--max-tokens", "5", *PROMPTS], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        line for index, out in enumerate(expected)
        for line in (f"Prompt {index}: {out.prompt!r}",
                     f"  [0] {out.outputs[0].text!r} ({out.outputs[0].finish_reason})")]
    assert "Generating" not in done.stderr and "\r" not in done.stderr


def test_the_cli_refuses_no_prompts() -> None:
    done = subprocess.run([sys.executable, "-m", "pagedkv.llm", "--model", "tiny-llama"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "no prompts: give them as arguments or with --prompts-file" in done.stderr


def test_close_stops_the_children(llm: LLM) -> None:
    """Runs after every other test of the module's LLM (pytest keeps the file's order): it
    closes it. Its children are the processes that name its private folder."""
    folder = Path(llm.daemon_target.removeprefix("unix://")).parent
    assert len(processes_mentioning(str(folder))) == 2
    llm.close()
    assert processes_mentioning(str(folder)) == []
    assert not folder.exists()
    with pytest.raises(RuntimeError, match="this LLM is closed"):
        llm.generate([1])
    llm.close()  # idempotent


def test_a_dead_runner_the_llm_started_fails_its_steps_at_once() -> None:
    """Nothing restarts the runner an LLM started itself: a step it leaves unanswered fails at
    once, with no wait for a restarted runner (an LLM on running services waits for one: see
    test_an_llm_on_running_daemon_and_runner)."""
    llm = LLM("tiny-llama", num_blocks=64)
    try:
        assert llm._engine.link.restart_wait_s == 0.0
        (runner,) = processes_mentioning(llm.runner_target.removeprefix("unix://"))
        os.kill(runner, signal.SIGKILL)
        with pytest.raises(RunnerUnreachable):
            llm.generate([1, 2, 3], SamplingParams(temperature=0, max_tokens=4))
    finally:
        llm.close()


# A script that starts an LLM on a preset and exits without closing it.
PRESET_SCRIPT = """
from pagedkv.client import DaemonUnavailable
from pagedkv.client.engine.runner_link import RESTART_WAIT_S
from pagedkv.llm import LLM, SamplingParams
llm = LLM("tiny-llama", num_blocks=64)
print(llm.daemon_target)
print(llm.generate([1, 2, 3], SamplingParams(temperature=0, max_tokens=4))[0].outputs[0].token_ids)
try:
    llm.generate("text")
except ValueError as exc:
    print(exc)
"""


def test_a_preset_and_the_children_stop_at_interpreter_exit() -> None:
    """A preset serves token ids and refuses text; the children stop, and their folder is
    removed, when the interpreter exits without close()."""
    done = subprocess.run([sys.executable, "-c", PRESET_SCRIPT], capture_output=True, text=True,
                          timeout=180)
    assert done.returncode == 0, done.stderr
    target, tokens, error = done.stdout.splitlines()
    assert len(eval(tokens)) == 4
    assert error == ("prompt 0 is text, but the preset 'tiny-llama' has random weights and no "
                     "tokenizer: pass token ids")
    folder = Path(target.removeprefix("unix://")).parent
    assert processes_mentioning(str(folder)) == []
    assert not folder.exists()


def test_a_child_that_fails_to_start_is_reported_with_its_log() -> None:
    """The daemon refuses a device that does not exist: `pagedkv generate` fails at once,
    quoting the daemon's log, and the LLM's private folder is removed."""
    with short_tmp_dir() as parent:
        done = subprocess.run([sys.executable, "-m", "pagedkv.llm", "--model", "tiny-llama",
                               "--device", "cuda:99", "--num-blocks", "64", "hello"],
                              capture_output=True, text=True, timeout=120,
                              env={**os.environ, "TMPDIR": str(parent)})
        assert done.returncode == 1, done.stderr
        assert done.stderr.startswith("pagedkv generate: failed: the pagedkvd process exited "
                                      "with status "), done.stderr
        assert "before it sent READY=1:\n" in done.stderr and "cuda:99" in done.stderr
        assert list(parent.iterdir()) == []

def processes_mentioning(text: str) -> list[int]:
    """Live processes whose command line holds `text`."""
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if text in (proc / "cmdline").read_bytes().decode(errors="replace"):
                    found.append(int(proc.name))
            except OSError:
                continue  # gone meanwhile
    return found


# ---------------------------------------------------------------- pieces, without a model

def test_pool_budget_on_cuda_and_cpu() -> None:
    """CUDA: utilization (default 0.9) x total - in use - weights - 1 GiB of activations; CPU:
    a quarter of the RAM left after the weights (or the utilization given), capped at 4 GiB
    and by /dev/shm."""
    cuda = DeviceMemory("cuda", total=80 * GiB, free=79 * GiB)
    assert embedded_budget(cuda, weights=16 * GiB, gpu_memory_utilization=0.9) \
        == int(0.9 * 80 * GiB) - GiB - 16 * GiB - GiB
    assert embedded_budget(cuda, weights=16 * GiB, gpu_memory_utilization=None) \
        == int(0.9 * 80 * GiB) - GiB - 16 * GiB - GiB
    assert embedded_budget(DeviceMemory("cpu", 0, free=10 * GiB, shm_free=64 * GiB), 2 * GiB,
                           None) == 2 * GiB
    assert embedded_budget(DeviceMemory("cpu", 0, free=10 * GiB, shm_free=64 * GiB), 2 * GiB,
                           0.125) == GiB
    assert embedded_budget(DeviceMemory("cpu", 0, free=64 * GiB, shm_free=64 * GiB), 0, None) \
        == CPU_KV_CAP
    assert embedded_budget(DeviceMemory("cpu", 0, free=64 * GiB, shm_free=GiB), 0, None) == GiB
    with pytest.raises(ValueError, match=r"no memory left for the KV cache on cuda.*give "
                                         r"kv_cache_memory or num_blocks"):
        embedded_budget(cuda, weights=70 * GiB, gpu_memory_utilization=0.9)


def test_progress_is_drawn_only_when_enabled() -> None:
    import io

    shown, hidden = io.StringIO(), io.StringIO()
    for stream, enabled in ((shown, True), (hidden, False)):
        bar = Progress(2, enabled, stream)
        bar.advance()
        bar.advance()
        bar.close()
    assert "2/2 prompts" in shown.getvalue() and shown.getvalue().endswith("\r\033[K")
    assert hidden.getvalue() == ""
