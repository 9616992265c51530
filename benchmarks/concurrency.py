"""Several trainings at once: three 1-rank barrier runs from three threads, against the same
three one after another, on one ``local[4]`` session.

Each run trains a small DDP job for a fixed number of steps (``--steps``, CPU, one thread per
rank) and returns. Variants, alternated round by round:

- ``sequential``: the three runs one after another from one thread;
- ``concurrent``: the three runs started together from three threads.

The figure is the wall time of all three, and the ratio concurrent / sequential: below 1 when
the runs overlap (the cluster has the slots and the machine the cores).

    python benchmarks/concurrency.py --repeats 3
"""

from __future__ import annotations

import argparse
import sys
import threading
from typing import Any

import common
import pages
from common import log, ratio

if __name__ == "__main__":  # not in a Spark worker that imports this module for a function
    common.prepare_environment()

NAME = "concurrency"
RUNS = 3


def train_steps(steps: int) -> int:
    """Run on the rank: ``steps`` SGD steps of a small MLP (one rank: DDP's work without a peer)."""
    import torch

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10)
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data = torch.randn(64, 256)
    target = torch.randint(0, 10, (64,))
    for _ in range(steps):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(data), target).backward()
        optimizer.step()
    return steps


def build_variants(session: Any, steps: int) -> dict[str, Any]:

    def one() -> int:
        distributor = common.ours(num_processes=1, local_mode=False, spark=session)
        return int(distributor.run(train_steps, steps))

    def sequential() -> list[int]:
        return [one() for _ in range(RUNS)]

    def concurrent() -> list[int]:
        values: list[Any] = [None] * RUNS

        def run(index: int) -> None:
            try:
                values[index] = one()
            except BaseException as exc:
                values[index] = exc

        threads = [threading.Thread(target=run, args=(i,)) for i in range(RUNS)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        for value in values:
            if isinstance(value, BaseException):
                raise value
        return values

    return {"sequential": sequential, "concurrent": concurrent}


def check(name: str, values: Any) -> dict[str, Any]:
    if len(values) != RUNS:
        raise AssertionError(f"{name}: {values!r}")
    return {}


def measure(args: argparse.Namespace) -> dict[str, Any]:
    log("starting a local[4] SparkSession")
    session = common.start_spark("local[4]")
    series = common.alternate(
        build_variants(session, args.steps),
        args.repeats,
        warmup=args.warmup,
        check=check,
        settle_s=args.settle,
    )
    session.stop()
    variants = {name: s.summary() for name, s in series.items()}
    return {
        "repeats": args.repeats,
        "steps": args.steps,
        "runs": RUNS,
        "master": "local[4]",
        "variants": variants,
        "concurrent_over_sequential": ratio(
            variants["concurrent"]["median_s"], variants["sequential"]["median_s"]
        ),
    }


def render(doc: dict[str, Any]) -> str:
    """This benchmark's section of benchmarks/README.md, from its JSON."""
    cols: list[pages.Column] = [
        ("variant", lambda n, _s: n),
        ("median s", pages.field_("median_s")),
        ("min-max s", pages.min_max),
        ("runs", lambda _n, s: str(s.get("runs", "-"))),
    ]
    return (
        f"{doc.get('runs')} one-rank barrier runs ({doc.get('steps')} SGD steps of a small MLP "
        f"each) on one `{doc.get('master')}` session: one after another from one thread, and "
        f"started together from {doc.get('runs')} threads. Wall time of all of them, median of "
        f"{doc.get('repeats')} alternating rounds.\n\n"
        + pages.columns(cols, doc["variants"])
        + f"\n\nconcurrent / sequential: {pages.num(doc.get('concurrent_over_sequential'), suffix='x')}"
        + "".join(pages.errors(s) for s in doc["variants"].values())
    )


def summary_rows(doc: dict[str, Any]) -> list[list[str]]:
    """README's headline row: three runs at once over the same one after another."""
    return [
        [
            f"{doc.get('runs')} barrier runs at once from threads (`{doc.get('master')}`)",
            "wall time at once / one after another",
            pages.num(doc.get("concurrent_over_sequential"), suffix="x"),
            "-",
        ]
    ]


BENCH = pages.Benchmark(
    name=NAME,
    title="Several runs at once",
    measure=measure,
    render=render,
    summary=summary_rows,
    options=lambda parser: parser.add_argument("--steps", type=int, default=300),
    defaults={"repeats": 3, "settle": 1.0},
    quick=("--repeats=1", "--warmup=0", "--steps=20"),
)

if __name__ == "__main__":
    sys.exit(common.main(BENCH))
