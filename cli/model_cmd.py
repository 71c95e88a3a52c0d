"""`pagedkv model sleep|wake|list`: the daemon's models, over its runner socket.

    pagedkv model list                 every registered model and its memory now
    pagedkv model sleep NAME           put a model to sleep (kvpool.proto SetModelState: its
                                       sessions closed, its cached blocks dropped, new sessions
                                       refused with ModelAsleep)
    pagedkv model wake NAME            accept its sessions again

Only runners may change a model's state, so the command calls the daemon's runner socket
(--daemon; default: the runtime folder's, vocab/paths.py): run it as the daemon's user or a
member of its runner_group. Exit 0 when done, 1 when the daemon refuses (its message printed:
an unknown model, a session a runner still holds) or cannot be reached, 2 for a bad command line.
"""

import argparse
import asyncio
import os
import sys

from pagedkv.client import PagedKVError, PoolClient
from pagedkv.client.pool.types import ModelInfo
from pagedkv.vocab.paths import default_daemon_runner_socket
from pagedkv.vocab.units import format_bytes

# Seconds to wait for the daemon before giving up.
CONNECT_TIMEOUT_S = 10.0


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """`pagedkv model`'s flags: the action, the model's name, the daemon's runner socket."""
    parser.add_argument("action", choices=("list", "sleep", "wake"))
    parser.add_argument("name", nargs="?", help="the model (sleep and wake)")
    parser.add_argument("--daemon", default=default_daemon_runner_socket(os.environ),
                        help="the daemon's runner socket (default: %(default)s)")


def run_model(args: argparse.Namespace) -> int:
    """Run `pagedkv model ...` parsed into `args`; the exit status."""
    if args.action != "list" and not args.name:
        print(f"pagedkv model {args.action}: name the model", file=sys.stderr)
        return 2
    try:
        return asyncio.run(_run(args.daemon, args.action, args.name))
    except PagedKVError as exc:
        print(f"pagedkv model {args.action}: {exc.message}", file=sys.stderr)
        return 1


async def _run(target: str, action: str, name: str | None) -> int:
    async with await PoolClient.connect(target, timeout=CONNECT_TIMEOUT_S) as client:
        if action == "list":
            for model in (await client.pool_info()).models:
                print(describe(model))
            return 0
        assert name is not None
        model = await client.set_model_state(name, action == "sleep")
        print(describe(model))
        return 0


def describe(model: ModelInfo) -> str:
    """One line of a model: name, geometry, state, memory now and its policy."""
    memory = (model.used_blocks + model.cached_blocks) * model.bytes_per_block
    policy = "".join(f" {key}={format_bytes(value, binary=True)}" for key, value in (
        ("min", model.min_memory), ("max", model.max_memory)) if value)
    return (f"{model.name}: {model.num_layers}x{model.num_kv_heads}x{model.head_dim} "
            f"{model.dtype}, {'asleep' if model.asleep else 'awake'}, {model.used_blocks} used "
            f"+ {model.cached_blocks} cached blocks ({format_bytes(memory, binary=True)}), "
            f"format pages {model.format_pages}{policy}"
            + (f", runner {model.runner_target}" if model.runner_target else ""))
