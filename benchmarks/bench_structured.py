"""JSON-schema-constrained generation against unconstrained generation: tokens/s of the same
prompts on the same `LLM` (issue 32's `structured_tok_s_ratio`, target at least 0.8).

One `LLM` (its own daemon and runner) on a tiny random Llama with a byte-level BPE tokenizer
(gpu_check.make_model_dir; no end-of-sequence token). Each round generates BATCH prompts twice,
once free and once under SCHEMA, the order alternating from round to round, so other work on
the machine weighs on both alike. Both sample (temperature 1, one seed per prompt) with
`ignore_eos` and MAX_TOKENS.

Equal lengths, honestly: SCHEMA's valid outputs are long, an object holding one string of at
least MIN_CHARS characters (`{"text": "...`), more than MAX_TOKENS tokens of this tokenizer can
spell, so the constraint never lets an output close before MAX_TOKENS: every output, free or
constrained, is exactly MAX_TOKENS long (the benchmark fails otherwise). The constraint still
works at every step: the bitmask of a JSON string (no raw control characters, escapes checked)
is filled and applied for every constrained sequence.

    free_tok_s                  generated tokens / s without a constraint (median round)
    structured_tok_s            the same prompts under SCHEMA (median round)
    structured_tok_s_ratio      structured / free per round, the median (target >= 0.8)

The constrained rounds include the runner's grammar work: one xgrammar bitmask filled per
constrained sequence per step, applied to the batch's logits in one call, the matcher advanced
by each sampled token. SCHEMA is compiled once (the runner's cache), in a warm-up round.

Usage: python benchmarks/bench_structured.py [--rounds 5] [--device cpu] [--quick]
"""

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from e2e import add_quick_flag, figure
from gpu_check import make_model_dir

from pagedkv.llm import LLM, SamplingParams, StructuredOutputs

BATCH = 16
MAX_TOKENS = 128
ROUNDS = 5
# Its one string holds at least MIN_CHARS characters: more than MAX_TOKENS tokens can spell.
MIN_CHARS = 4096
SCHEMA = {"type": "object", "properties": {"text": {"type": "string", "minLength": MIN_CHARS}},
          "required": ["text"], "additionalProperties": False}
WORDS = ["the", "cat", "sat", "on", "mat", "a", "dog", "ran", "in", "park"]


def prompts(count: int) -> list[str]:
    return [" ".join(WORDS[(i + j) % len(WORDS)] for j in range(4 + i % 5)) for i in range(count)]


def params(count: int, max_tokens: int, constrained: bool) -> list[SamplingParams]:
    constraint = StructuredOutputs(json=json.dumps(SCHEMA)) if constrained else None
    return [SamplingParams(temperature=1.0, seed=i, max_tokens=max_tokens, ignore_eos=True,
                           structured_outputs=constraint) for i in range(count)]


def run(llm: LLM, texts: list[str], max_tokens: int, constrained: bool) -> float:
    """Generated tokens/s of one batch; every output must be max_tokens long."""
    started = time.perf_counter()
    outputs = llm.generate(texts, params(len(texts), max_tokens, constrained))
    elapsed = time.perf_counter() - started
    lengths = [len(out.outputs[0].token_ids) for out in outputs]
    if lengths != [max_tokens] * len(texts):
        raise SystemExit(f"outputs of {lengths} tokens, not all {max_tokens}: lengths differ")
    if constrained and not all(out.outputs[0].text.startswith('{"text":') for out in outputs):
        raise SystemExit("a constrained output does not begin as SCHEMA says")
    return sum(lengths) / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--device", default="cpu")
    add_quick_flag(parser)
    args = parser.parse_args()
    batch, max_tokens, rounds = (4, 16, 1) if args.quick else (BATCH, MAX_TOKENS, args.rounds)
    texts = prompts(batch)
    with tempfile.TemporaryDirectory() as folder:
        make_model_dir(Path(folder), "llama")
        with LLM(model=folder, device=args.device, max_num_seqs=batch) as llm:
            run(llm, texts, 8, True)  # warm-up: the schema compiles, the model warms
            run(llm, texts, 8, False)
            free: list[float] = []
            structured: list[float] = []
            for round_ in range(rounds):
                for constrained in ((True, False) if round_ % 2 else (False, True)):
                    (structured if constrained else free).append(
                        run(llm, texts, max_tokens, constrained))
    ratios = [s / f for s, f in zip(structured, free, strict=True)]
    figure("free_tok_s", statistics.median(free), "tok/s", 1)
    figure("structured_tok_s", statistics.median(structured), "tok/s", 1)
    figure("structured_tok_s_ratio", statistics.median(ratios), "ratio")


if __name__ == "__main__":
    main()
