"""`pagedkv runner` (also `python -m pagedkv.model_runner`): the runner process's command line.

    pagedkvd --model-config tiny-llama &                 # the daemon, its pool laid out for it
    pagedkv runner --random-init tiny-llama             # the runner next to it
    pagedkv runner --model /models/qwen2.5-0.5b --daemon unix:///run/pagedkv/pagedkvd-runners.sock
    pagedkv runner --model /models/qwen-ft --model-name qwen-ft --listen unix:///run/pagedkv/ft.sock

Exit codes as the daemon's: 2 for a bad setting or a model that does not fit the pool (a restart
would fail the same way), 1 when the runner could not start or failed while running.
"""

import argparse
import asyncio
import os
import sys

from pagedkv.model_runner.engine.answer_limits import DEFAULT_MAX_LOGPROBS, AnswerLimits
from pagedkv.model_runner.engine.holds import DEFAULT_HOLD_MS
from pagedkv.model_runner.process.scheduling import yield_to_forwards
from pagedkv.process import log_setup
from pagedkv.process.server_bounds import SERVER_BOUNDS, ServerBounds
from pagedkv.proto.limits import DEFAULT_ANSWER_BYTES, MAX_MESSAGE_BYTES
from pagedkv.vocab.geometry import KV_CACHE_DTYPES, MODEL_DTYPES
from pagedkv.vocab.paths import DAEMON_RUNNER_SOCKET_NAME, RUNNER_SOCKET_NAME

EXIT_BAD_CONFIG = 2
EXIT_FAILURE = 1


def parser() -> argparse.ArgumentParser:
    cli = argparse.ArgumentParser(
        prog="pagedkv runner",
        description="Serve a Hugging Face model on a pagedkv daemon's KV pool (gRPC Runner).")
    source = cli.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", metavar="PATH",
                        help="a local Hugging Face model directory (no hub access)")
    source.add_argument("--random-init", metavar="CONFIG",
                        help="a config.json path or a preset (tiny, tiny-llama, small-llama), "
                             "randomly initialized")
    cli.add_argument("--seed", type=int, default=0, help="seed of --random-init (default 0)")
    cli.add_argument("--tokenizer", metavar="PATH",
                     help="the tokenizer's local folder, which structured outputs compile "
                          "against (default: --model's folder; a --random-init preset has none "
                          "and refuses structured outputs without it)")
    cli.add_argument("--model-name", metavar="NAME",
                     help="the name the model registers under with the daemon, which its "
                          "clients' sessions name (default: the preset's name, or the model "
                          "folder's basename: the name the daemon gives its own model)")
    cli.add_argument("--dtype", choices=MODEL_DTYPES,
                     help="load the weights in this dtype (default: the config's); start the "
                          "daemon with the same --dtype")
    cli.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                     help="the KV cache's dtype: auto (the weights') or fp8 (e4m3, half an "
                          "fp16 block); the daemon's format for the model must be the same "
                          "(pagedkvd --kv-cache-dtype for its own model)")
    cli.add_argument("--daemon", help="the daemon's runner socket, unix:///path (default: "
                                      f"{DAEMON_RUNNER_SOCKET_NAME} in $RUNTIME_DIRECTORY, else "
                                      "./run)")
    cli.add_argument("--listen", help="unix:///path of the Runner socket (default: "
                                      f"{RUNNER_SOCKET_NAME} in $RUNTIME_DIRECTORY, else ./run)")
    cli.add_argument("--attention-backend", choices=("auto", "triton", "cpu", "torch"),
                     default="auto",
                     help="auto: the Triton kernels on CUDA, the C kernels (cpu) on CPU; torch: "
                          "their vectorized torch twins, the reference")
    cli.add_argument("--cuda-graphs", action="store_true",
                     help="replay decode steps from CUDA graphs, one per batch-size bucket "
                          "(1..256 sequences; needs CUDA and the triton backend; default off: "
                          "eager)")
    cli.add_argument("--torch-threads", type=int, default=0,
                     help="intra-op threads of the CPU forward (default: half the cores, at "
                          "least 1: the daemon and the clients need the others)")
    cli.add_argument("--max-batch-tokens", type=int, default=8192,
                     help="most tokens one merged forward pass computes; a longer prefill is "
                          "split across forwards, other clients' decodes between (default 8192)")
    cli.add_argument("--hold-ms", type=int, default=DEFAULT_HOLD_MS,
                     help="how long each daemon call before a forward holds the client's "
                          "session: no client frees its blocks meanwhile; renewed while the "
                          "forward runs; at most the daemon's max_hold_ms (default "
                          f"{DEFAULT_HOLD_MS})")
    cli.add_argument("--max-logprobs", type=int, default=DEFAULT_MAX_LOGPROBS,
                     help="most top logprobs a sequence may ask for (default "
                          f"{DEFAULT_MAX_LOGPROBS}, vLLM's)")
    cli.add_argument("--max-answer-bytes", type=int, default=DEFAULT_ANSWER_BYTES,
                     help="most encoded bytes of one step's answer; a step that could pass it "
                          f"is refused (default {DEFAULT_ANSWER_BYTES}, under gRPC's default "
                          f"receive limit; at most {MAX_MESSAGE_BYTES})")
    cli.add_argument("--keep-pool", action="store_true",
                     help="keep a descriptor of the mapped pool file and hand it back to a "
                          "daemon restarted with restore = auto and no systemd fd store (at "
                          "--listen + .pool; its user only); meanwhile the memory stays "
                          "allocated (default off)")
    cli.add_argument("--metrics-listen", metavar="HOST:PORT",
                     help="serve /metrics, /healthz and /readyz here")
    defaults = ServerBounds()
    for name, spec in SERVER_BOUNDS.items():  # the daemon's settings of the same names
        cli.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(defaults, name),
                         help=f"{spec.help} (default {getattr(defaults, name)}; "
                              f"{spec.minimum}..{spec.maximum})")
    cli.add_argument("--log-level", choices=log_setup.LOG_LEVELS, default="info")
    cli.add_argument("--log-format", choices=log_setup.LOG_FORMATS, default="auto")
    return cli


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    yield_to_forwards()  # before any thread starts: each inherits it (scheduling.py)
    # Imported only now: torch and transformers take seconds to load, --help needs neither.
    from pagedkv.model_runner.models import ModelMismatch, ModelSource
    from pagedkv.model_runner.process.server import RunnerConfig, serve

    log_setup.configure(args.log_level, args.log_format)
    import torch

    # Two OpenMP threads on a 2-core host shared with the daemon made forwards 10-30x slower
    # (benchmarks/bench_runner.py --threads 0); GPU runs barely use these threads.
    torch.set_num_threads(args.torch_threads or max(1, (os.cpu_count() or 2) // 2))
    try:
        source = ModelSource(path=args.model, random_init=args.random_init, seed=args.seed,
                             dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype)
        options = {key: value for key, value in (("daemon", args.daemon),
                                                 ("listen", args.listen),
                                                 ("metrics_listen", args.metrics_listen))
                   if value is not None}
        bounds = ServerBounds(**{name: getattr(args, name) for name in SERVER_BOUNDS})
        config = RunnerConfig(model=source, model_name=args.model_name,
                              tokenizer=args.tokenizer,
                              attention_backend=args.attention_backend,
                              cuda_graphs=args.cuda_graphs, keep_pool=args.keep_pool,
                              server_bounds=bounds,
                              max_batch_tokens=args.max_batch_tokens, hold_ms=args.hold_ms,
                              answer_limits=AnswerLimits(args.max_logprobs,
                                                         args.max_answer_bytes), **options)
        asyncio.run(serve(config))
    except (ModelMismatch, ValueError) as exc:
        print(f"pagedkv runner: error: {exc}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    except Exception as exc:  # the daemon unreachable, a socket in use, ...
        print(f"pagedkv runner: cannot run: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    return 0


if __name__ == "__main__":
    sys.exit(main())
