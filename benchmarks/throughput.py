"""Training throughput: a small CNN, DDP on 2 ranks, fixed steps; ours vs bare torchrun.

The same code (``jobs.train_cnn``) runs as a script under bare ``torchrun`` and under ours in
local mode (as the same script, as a function, and as the script with
``--start-method=spawn``), alternating round by round after a
discarded warm-up round. Rank 0 times the steady state (after ``--warmup`` steps, between two
barriers) and reports samples/s over all ranks: that is the figure compared. The wall time of
the whole run is reported too.

Both launchers get the same ``OMP_NUM_THREADS`` (``--omp-threads``, default: cores / 2, the
value ours would choose) so that the comparison is of the launch path, not of thread counts:
torchrun's own default is 1 thread per rank whatever the machine.

    python benchmarks/throughput.py --repeats 5
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from collections.abc import Callable
from typing import Any

import common
from common import JOBS_SCRIPT, log, median, print_table, ratio

common.prepare_environment()

import jobs  # noqa: E402  (needs the benchmarks dir on sys.path, set just above)

NAME = "throughput"


def parse_figures(stdout: str) -> dict[str, Any]:
    """Rank 0's ``THROUGHPUT {json}`` line."""
    for line in stdout.splitlines():
        if "THROUGHPUT " in line:
            return dict(json.loads(line.split("THROUGHPUT ", 1)[1]))
    raise AssertionError(f"no THROUGHPUT line in rank 0's output: {stdout[-500:]!r}")


def build_variants(
    steps: int, batch_size: int, warmup: int, use_gpu: bool, omp: str | None, timeout: float
) -> dict[str, Callable[[], Any]]:
    """name -> run once; each returns rank 0's figures."""
    from sparktorch_ops import TorchDistributor

    env = {"OMP_NUM_THREADS": omp} if omp else {}
    script_args = ["cnn", f"--steps={steps}", f"--batch-size={batch_size}", f"--warmup={warmup}"]
    if use_gpu:
        script_args.append("--gpu")
    logger = common.quiet_logger()

    def ours(*torchrun_args: str) -> TorchDistributor:
        return TorchDistributor(
            num_processes=2,
            local_mode=True,
            use_gpu=use_gpu,
            env=env,
            logger=logger,
            timeout=timeout,
            torchrun_args=torchrun_args,
        )

    def bare() -> dict[str, Any]:
        proc = common.run_torchrun(JOBS_SCRIPT, script_args, env=env, timeout=timeout)
        return parse_figures(proc.stdout)

    return {
        "torchrun": bare,
        "ours_local_script": lambda: parse_figures(ours().run(str(JOBS_SCRIPT), *script_args)),
        "ours_local_fn": lambda: ours().run(
            functools.partial(jobs.train_cnn, steps, batch_size, warmup, use_gpu)
        ),
        # Ranks forked from a freshly spawned supervisor instead of from the agent.
        "ours_local_script_spawn": lambda: parse_figures(
            ours("--start-method=spawn").run(str(JOBS_SCRIPT), *script_args)
        ),
    }


def check(name: str, figures: Any) -> dict[str, Any]:
    if not isinstance(figures, dict) or figures.get("world_size") != 2:
        raise AssertionError(f"{name}: unexpected figures {figures!r}")
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup-rounds", type=int, default=1)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=10, help="untimed training steps per run")
    parser.add_argument(
        "--omp-threads",
        type=int,
        default=max(1, (os.cpu_count() or 2) // 2),
        help="0: each launcher's own default",
    )
    parser.add_argument("--gpu", action="store_true", help="use_gpu=True, nccl")
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--settle", type=float, default=0.5)
    parser.add_argument("--name", default=NAME)
    args = parser.parse_args(argv)

    machine = common.machine_info()
    omp = str(args.omp_threads) if args.omp_threads > 0 else None
    variants = build_variants(args.steps, args.batch_size, args.warmup, args.gpu, omp, args.timeout)
    series = common.alternate(
        variants, args.repeats, warmup=args.warmup_rounds, check=check, settle_s=args.settle
    )

    base_rate = median([e["samples_per_s"] for e in series["torchrun"].extra])
    base_wall = median(series["torchrun"].seconds)
    results: dict[str, Any] = {}
    rows = []
    for name, s in series.items():
        summary = s.summary()
        rate = median([e["samples_per_s"] for e in s.extra])
        summary.update(
            {
                "samples_per_s_median": rate,
                "samples_per_s": [round(e["samples_per_s"], 1) for e in s.extra],
                "rate_ratio_vs_torchrun": ratio(rate, base_rate),
                "wall_ratio_vs_torchrun": ratio(summary["median_s"], base_wall),
                "omp_num_threads_seen": sorted({str(e.get("omp_num_threads")) for e in s.extra}),
                "torch_threads_seen": sorted({int(e.get("torch_threads", 0)) for e in s.extra}),
            }
        )
        results[name] = summary
        rows.append(
            [
                name,
                rate,
                summary["rate_ratio_vs_torchrun"],
                summary["median_s"],
                summary["wall_ratio_vs_torchrun"],
                ",".join(summary["omp_num_threads_seen"]),
                f"{summary['runs']} ok"
                + (f", {len(summary['errors'])} failed" if summary["errors"] else ""),
            ]
        )
    print_table(
        f"Throughput: CNN, DDP 2 ranks, {args.steps} steps x batch {args.batch_size}, medians of {args.repeats}",
        ["variant", "samples/s", "x torchrun", "wall s", "wall x", "OMP threads", "runs"],
        rows,
    )
    common.write_results(
        args.name,
        {
            "repeats": args.repeats,
            "steps": args.steps,
            "batch_size": args.batch_size,
            "warmup_steps": args.warmup,
            "omp_num_threads": omp,
            "use_gpu": args.gpu,
            "variants": results,
            "notes": "samples/s: rank 0's steady state over all ranks (between barriers, after warm-up steps).",
        },
        machine,
    )
    log("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
