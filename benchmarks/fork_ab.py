"""Does a forked rank compute slower than a fresh interpreter? A paired, step-by-step A/B.

``throughput.py`` compares whole runs; on this shared 2-core VM run-to-run drift (steal,
frequency) moves a DDP run's samples/s by 10-30 %, so 30 paired rounds still leave a +-4 %
interval. Here the two processes under comparison train *at the same time, in turns*: a rank of
ours (forked from the agent, which the warm agent forked: the default) and the rank of a bare
``torchrun``, each a one-rank job of the same script, hand a token to each other through two
FIFOs, so they alternate step by step (~30 ms apart, never both computing). Drift on any scale
longer than a step hits both alike; the paired per-step ratio is what is left. Each step of the
same small CNN (single-threaded, ``OMP_NUM_THREADS=1``), its minor faults and context switches
are recorded inside each rank.

Variants paired with bare torchrun: ours default (warm agent, forked rank), ours with the warm
agent off (cold agent, forked rank), ours with ``--start-method=spawn``, and the control: bare
torchrun against bare torchrun (what the harness reads when nothing differs). Each pair runs
``--sessions`` times, who starts first alternating. The figure is forked speed / fresh speed
(> 1: ours faster) as the geometric mean of per-step ratios, with a 95 % bootstrap interval
over sessions and blocks of 50 consecutive steps within them (steps are not independent).

Both processes are pinned to the same CPU (they never compute at once), so a session compares
processes, not two virtual cores. Usage: ``python benchmarks/fork_ab.py [--steps 400]
[--sessions 4]`` (about 6 minutes).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import common, pages

SCRIPT = str(Path(__file__).resolve())
# variant -> the warm-agent switch for its run (None: the default, on)
VARIANTS: dict[str, str | None] = {
    "ours_default": None,
    "ours_warm_off": "0",
    "ours_spawn": None,
    "torchrun_a_a": None,  # the control: a second bare torchrun in ours' place
}
BLOCK = 50


def rank_main(turn_in: str, turn_out: str, steps: int, warmup: int, out: str) -> None:
    """One side of the A/B: train ``warmup + steps`` steps, each when it holds the token."""
    # Both sides on the same CPU (they never compute at once): a session then compares the
    # processes, not two virtual cores of unequal speed.
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    import torch
    from torch import nn

    from benchmarks.jobs import small_cnn

    torch.manual_seed(0)
    model = small_cnn()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    images = torch.randn(64 * 8, 1, 28, 28)
    labels = torch.randint(0, 10, (64 * 8,))
    reader = os.open(turn_in, os.O_RDWR)
    writer = os.open(turn_out, os.O_RDWR)
    times, faults, switches = [], [], []
    for index in range(warmup + steps):
        os.read(reader, 1)
        before = resource.getrusage(resource.RUSAGE_SELF)
        started = time.perf_counter()
        lo = (index % 8) * 64
        optimizer.zero_grad(set_to_none=True)
        loss_fn(model(images[lo : lo + 64]), labels[lo : lo + 64]).backward()
        optimizer.step()
        elapsed = time.perf_counter() - started
        after = resource.getrusage(resource.RUSAGE_SELF)
        os.write(writer, b"t")
        if index >= warmup:
            times.append(elapsed)
            faults.append(after.ru_minflt - before.ru_minflt)
            switches.append(after.ru_nivcsw - before.ru_nivcsw + after.ru_nvcsw - before.ru_nvcsw)
    Path(out).write_text(
        json.dumps(
            {
                "step_s": times,
                "minflt": faults,
                "csw": switches,
                "threads": torch.get_num_threads(),
                "pid": os.getpid(),
                "cmdline": Path("/proc/self/cmdline").read_bytes().split(b"\0")[:4],
            },
            default=lambda b: b.decode(errors="replace"),
        )
    )


def session(variant: str, steps: int, warmup: int, ours_first: bool) -> dict[str, Any]:
    """One A/B session: ours' one-rank run and bare torchrun's, alternating steps."""
    from sparktorch_ops import TorchDistributor

    with tempfile.TemporaryDirectory(prefix="fork-ab-") as tmp:
        fifo = {side: os.path.join(tmp, side) for side in ("ours", "torchrun")}
        for path in fifo.values():
            os.mkfifo(path)
        holders = [os.open(path, os.O_RDWR) for path in fifo.values()]  # neither side blocks
        out = {side: os.path.join(tmp, f"{side}.json") for side in fifo}
        args = {
            "ours": [fifo["ours"], fifo["torchrun"], str(steps), str(warmup), out["ours"]],
            "torchrun": [fifo["torchrun"], fifo["ours"], str(steps), str(warmup), out["torchrun"]],
        }
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        bare = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nproc-per-node=1",
                "--standalone",
                SCRIPT,
                "rank",
                *args["torchrun"],
            ],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        torchrun_args = ["--start-method=spawn"] if variant == "ours_spawn" else None
        errors: list[BaseException] = []

        def run_ours() -> None:
            try:
                with common.env_var(common.WARM_AGENT_ENV, VARIANTS[variant]):
                    TorchDistributor(
                        num_processes=1,
                        local_mode=True,
                        use_gpu=False,
                        env={"OMP_NUM_THREADS": "1"},
                        torchrun_args=torchrun_args,
                    ).run(SCRIPT, "rank", *args["ours"])
            except BaseException as exc:
                errors.append(exc)

        def run_control() -> None:
            control = subprocess.Popen(
                [*bare.args[:-5], *args["ours"]],  # type: ignore[index]
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            if control.wait():
                errors.append(RuntimeError(f"control torchrun exited {control.returncode}"))

        ours = threading.Thread(target=run_control if variant == "torchrun_a_a" else run_ours)
        ours.start()
        os.write(holders[0 if ours_first else 1], b"t")  # the first token
        ours.join()
        bare.wait()
        for fd in holders:
            os.close(fd)
        if errors or bare.returncode:
            raise RuntimeError(f"{variant}: ours {errors!r}, torchrun exit {bare.returncode}")
        return {side: json.loads(Path(path).read_text()) for side, path in out.items()}


def ratio_with_interval(sessions: list[tuple[list[float], list[float]]]) -> dict[str, Any]:
    """Geometric mean of fresh/ours step time (ours' speed relative to a fresh interpreter),
    with a two-level bootstrap: sessions, then blocks of ``BLOCK`` steps within each (steps of
    one session are not independent, and sessions differ)."""
    per_session = []
    for ours, bare in sessions:
        logs = [math.log(b / o) for o, b in zip(ours, bare, strict=True)]
        per_session.append(
            [sum(logs[i : i + BLOCK]) / BLOCK for i in range(0, len(logs) - BLOCK + 1, BLOCK)]
        )
    rng = random.Random(0)
    boot = []
    for _ in range(10_000):
        chosen = [rng.choice(per_session) for _ in per_session]
        boot.append(sum(sum(rng.choice(s) for _ in s) / len(s) for s in chosen) / len(chosen))
    boot.sort()
    session_means = [sum(s) / len(s) for s in per_session]
    return {
        "ratio": math.exp(sum(session_means) / len(session_means)),
        "ci_low": math.exp(boot[250]),
        "ci_high": math.exp(boot[9_749]),
        "session_ratios": [round(math.exp(m), 4) for m in session_means],
        "steps": sum(len(o) for o, _ in sessions),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--sessions", type=int, default=4)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    args = parser.parse_args(argv)
    from sparktorch_ops import TorchDistributor

    TorchDistributor(num_processes=1, local_mode=True, use_gpu=False).run(SCRIPT, "noop")
    results: dict[str, Any] = {}
    for variant in args.variants.split(","):
        pairs: list[tuple[list[float], list[float]]] = []
        counters: dict[str, list[float]] = {
            "ours_minflt": [],
            "bare_minflt": [],
            "ours_csw": [],
            "bare_csw": [],
        }
        for index in range(args.sessions):
            common.log(f"{variant}: session {index + 1}/{args.sessions}")
            got = session(variant, args.steps, args.warmup, ours_first=index % 2 == 0)
            pairs.append((got["ours"]["step_s"], got["torchrun"]["step_s"]))
            for side, key in (("ours", "ours"), ("torchrun", "bare")):
                counters[f"{key}_minflt"] += got[side]["minflt"]
                counters[f"{key}_csw"] += got[side]["csw"]
        figures = ratio_with_interval(pairs)
        ours_steps = [t for ours, _ in pairs for t in ours]
        bare_steps = [t for _, bare in pairs for t in bare]
        figures.update(
            {
                "ours_step_ms_median": 1000 * sorted(ours_steps)[len(ours_steps) // 2],
                "bare_step_ms_median": 1000 * sorted(bare_steps)[len(bare_steps) // 2],
                **{f"{k}_per_step": sum(v) / len(v) for k, v in counters.items()},
            }
        )
        results[variant] = figures
        common.log(f"{variant}: {json.dumps(figures)}")
    print()
    print(
        f"Forked vs fresh rank, paired A/B (steps alternate; {args.sessions} x {args.steps} steps)"
    )
    print(
        f"{'variant':16s} {'speed x fresh':>13s} {'95% CI':>15s} {'ours ms':>8s} {'fresh ms':>8s} "
        f"{'minflt ours/fresh':>18s} {'csw ours/fresh':>15s}"
    )
    for name, f in results.items():
        print(
            f"{name:16s} {f['ratio']:13.4f} {f['ci_low']:7.4f}-{f['ci_high']:.4f} "
            f"{f['ours_step_ms_median']:8.2f} {f['bare_step_ms_median']:8.2f} "
            f"{f['ours_minflt_per_step']:8.2f}/{f['bare_minflt_per_step']:<9.2f} "
            f"{f['ours_csw_per_step']:6.2f}/{f['bare_csw_per_step']:<8.2f}"
        )
    common.write_results(
        "fork_ab",
        {
            "benchmark": "fork_ab",
            "steps": args.steps,
            "warmup_steps": args.warmup,
            "sessions": args.sessions,
            "block": BLOCK,
            "variants": results,
        },
        common.machine_info(),
    )
    return 0


# -- its section of benchmarks/README.md (run_all.py collects it) --------------------------
TITLE = "Forked vs fresh rank"


FORK_AB_LABELS = {
    "ours_default": "ours, default (warm agent, forked rank)",
    "ours_warm_off": "ours, warm agent off (forked rank)",
    "ours_spawn": "ours, `--start-method=spawn`",
    "torchrun_a_a": "control: bare torchrun in ours' place",
}


def render(doc: dict[str, Any]) -> str:
    """This benchmark\'s section of benchmarks/README.md, from its JSON."""
    variants = doc["variants"]
    rows = []
    for name, s in variants.items():
        ratio = s.get("ratio")
        low, high = s.get("ci_low"), s.get("ci_high")
        sessions = s.get("session_ratios") or []
        rows.append(
            [
                f"`{name}`",
                FORK_AB_LABELS.get(name, "-"),
                pages.num(ratio, 3, "x"),
                f"{low:.3f}-{high:.3f}" if low is not None and high is not None else "-",
                ", ".join(f"{r:.3f}" for r in sessions) or "-",
                f"{pages.num(s.get('ours_step_ms_median'))} / {pages.num(s.get('bare_step_ms_median'))}",
                f"{pages.num(s.get('ours_minflt_per_step'), 0)} / "
                f"{pages.num(s.get('bare_minflt_per_step'), 0)}",
                f"{pages.num(s.get('ours_csw_per_step'))} / {pages.num(s.get('bare_csw_per_step'))}",
                str(s.get("steps", "-")),
            ]
        )
    control = (variants.get("torchrun_a_a") or {}).get("session_ratios") or []
    control_line = (
        f"\n\nThe control (bare vs bare) spans {min(control):.3f}-{max(control):.3f} across "
        "sessions: what the harness reads when nothing differs."
        if control
        else ""
    )
    return (
        "The same small CNN, single-threaded (`OMP_NUM_THREADS=1`), as two one-rank jobs at "
        "once: ours' rank and a bare `torchrun`'s hand a token to each other through two FIFOs, "
        "so they train one step each in turn, never both at once, both pinned to the same CPU. "
        "Drift on any scale longer than a step hits both alike. "
        f"{doc.get('sessions')} sessions per variant (who starts first alternating), each "
        f"{doc.get('steps')} steps after {doc.get('warmup_steps')} warm-up steps. "
        "*speed x fresh*: our rank's speed over the fresh torchrun rank's, the geometric mean "
        "of per-step fresh / ours step time (> 1: ours faster), with a 95% bootstrap interval "
        f"(resampling sessions, then blocks of {doc.get('block')} consecutive steps within "
        "them); *per session*: the same per session. Step time, minor faults and context "
        "switches (voluntary and involuntary) per step are measured inside each rank; in the "
        "control, *ours* is the second bare torchrun.\n\n"
        + pages.table(
            [
                "variant",
                "what",
                "speed x fresh",
                "95% CI",
                "per session",
                "median step ms, ours / fresh",
                "minor faults per step, ours / fresh",
                "context switches per step, ours / fresh",
                "steps",
            ],
            rows,
        )
        + control_line
        + pages.notes(doc.get("notes"))
    )


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "rank":
        rank_main(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), sys.argv[6])
    elif len(sys.argv) > 1 and sys.argv[1] == "noop":
        pass
    else:
        sys.exit(main())
