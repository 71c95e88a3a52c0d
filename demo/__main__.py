"""`make demo`: two client processes serve a mixed workload through one daemon and one runner
on the CPU; a short report of what paging gives, against contiguous max-length reservation.

    python -m pagedkv.demo [--quick] [--output demo-output]

1. Start, in a private temporary folder and on unix sockets, two stacks of a daemon and a
   runner on the random-initialized "tiny" model: `pagedkvd` paging a pool of NUM_BLOCKS
   blocks (QUICK_NUM_BLOCKS with --quick), and `pagedkvd --allocator contiguous` on the same
   pool, where each sequence reserves the workload's longest sequence up front.
2. Run the workload (`workload`) from two client processes (`worker`, one `Engine` and daemon
   session each) on the paged stack, then on the contiguous one, sampling the daemon's /metrics.
3. Stop every process (SIGTERM: each must exit with status 0, and no pool file may be left),
   write report.txt and kv_blocks.svg (blocks used, running sequences and filled token slots
   over time, both runs) to the output folder, and print the report.
"""

import argparse
import sys
import tempfile
import time
from pathlib import Path

from pagedkv.demo.report import chart, report
from pagedkv.demo.runs import DemoFailed, RunResult, run_workload, started_stacks, stop_stacks
from pagedkv.demo.workload import (
    BLOCK_SIZE,
    MODEL,
    NUM_BLOCKS,
    NUM_WORKERS,
    QUICK_NUM_BLOCKS,
    max_model_len,
    workload,
)
from pagedkv.process.launch import NoNotification

REPORT_NAME = "report.txt"
CHART_NAME = "kv_blocks.svg"


def say(text: str = "") -> None:
    print(text, flush=True)


def run_both(quick: bool) -> list[RunResult]:
    """The workload on a paged stack, then on a contiguous one; every process stopped."""
    requests = sum(len(workload(index, quick)) for index in range(NUM_WORKERS))
    num_blocks, reserve = QUICK_NUM_BLOCKS if quick else NUM_BLOCKS, max_model_len(quick)
    with tempfile.TemporaryDirectory(prefix="pkv-demo-") as folder:
        say(f"Starting pagedkvd twice ({num_blocks} blocks of {BLOCK_SIZE} tokens: paged, and "
            f"contiguous reserving {reserve} tokens a sequence), each with a runner on the "
            f"{MODEL!r} model")
        began = time.monotonic()
        with started_stacks(Path(folder), num_blocks, [None, reserve]) as stacks:
            say(f"Ready in {time.monotonic() - began:.1f} s (READY=1 from each process).")
            runs = []
            for stack in stacks:
                say(f"[{stack.allocator}] {requests} requests from {NUM_WORKERS} client "
                    "processes ...")
                runs.append(run_workload(stack, quick))
                say(f"[{stack.allocator}] done in "
                    f"{runs[-1].finished_s - runs[-1].started_s:.1f} s")
            stop_stacks(stacks)
        say("Stopped: every runner and daemon exited with status 0 on SIGTERM; no pool file "
            "left.")
    return runs


def main(argv: list[str] | None = None) -> int:
    cli = argparse.ArgumentParser(prog="python -m pagedkv.demo", description=__doc__,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
    cli.add_argument("--quick", action="store_true",
                     help="a reduced workload (a few seconds a run; for tests)")
    cli.add_argument("--output", type=Path, default=Path("demo-output"),
                     help="folder for report.txt and kv_blocks.svg (default ./demo-output)")
    args = cli.parse_args(argv)
    try:
        paged, contiguous = run_both(args.quick)
    except (DemoFailed, NoNotification) as exc:
        print(f"demo failed: {exc}", file=sys.stderr)
        return 1
    text = report(paged, contiguous)
    args.output.mkdir(parents=True, exist_ok=True)
    (args.output / REPORT_NAME).write_text(text)
    (args.output / CHART_NAME).write_text(chart([paged, contiguous]))
    say()
    say(text)
    say(f"Written: {args.output / REPORT_NAME}, {args.output / CHART_NAME}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
