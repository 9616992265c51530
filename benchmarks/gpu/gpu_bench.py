"""GPU launch and throughput: ours (local mode, ``use_gpu=True``, NCCL) vs bare torchrun.

    python benchmarks/gpu/gpu_bench.py --out "$OUT"     # on the GPU machine
    python benchmarks/gpu/gpu_bench.py --quick          # a CPU smoke run (--device cpu --smoke)

Variants alternate round by round, the order rotated each round (drift hits all alike):

- launch: ``jobs.py allreduce --gpu`` (init NCCL, all-reduce one tensor) as bare ``torchrun``, through
  ``TorchDistributor.run(script)``; wall time from the driver's call to its return.
- throughput: ``resnet_bench.py`` (DDP ResNet-50, synthetic 224x224 images, bf16 autocast,
  channels-last) the same two ways; images/s as rank 0 measured it, and the wall time.

Needs no Spark and no Java: local mode only. Writes ``gpu_bench.json`` into ``--out``
(default ``benchmarks/results/gpu``) and prints its section of the page.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/

import common
import pages

HERE = Path(__file__).resolve().parent
RESNET = HERE / "resnet_bench.py"


def result_line(text: str) -> dict[str, Any]:
    """Rank 0's ``RESULT {json}`` line of a run's output."""
    for line in reversed(text.splitlines()):
        if "RESULT {" in line:
            parsed: dict[str, Any] = json.loads(line[line.index("RESULT {") + len("RESULT ") :])
            return parsed
    raise RuntimeError(f"no RESULT line in the output:\n{text[-3000:]}")


def ours(nproc: int, use_gpu: bool, script: Path, args: list[str]) -> dict[str, Any]:
    """Run the script through TorchDistributor in local mode; rank 0's RESULT."""
    from sparktorch_ops.distributor import TorchDistributor

    quiet = logging.getLogger("gpu_bench.ranks")
    quiet.propagate = False
    quiet.addHandler(logging.NullHandler())
    output = TorchDistributor(
        num_processes=nproc, local_mode=True, use_gpu=use_gpu, logger=quiet
    ).run(str(script), *args)
    return result_line(output)


def environment(use_gpu: bool) -> dict[str, Any]:
    """CUDA's and NCCL's versions and the GPUs' names (what the machine line lacks)."""
    import torch

    if not use_gpu:
        return {}
    version = torch.cuda.nccl.version()
    return {
        "cuda": torch.version.cuda,
        "nccl": ".".join(map(str, version)) if isinstance(version, tuple) else str(version),
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
    }


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Both comparisons, each alternating bare torchrun and ours."""
    import torch

    use_gpu = args.device == "cuda"
    if use_gpu and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: pass --device cpu for a smoke run")
    nproc = args.nproc or (torch.cuda.device_count() if use_gpu else 2)
    launch_args = ["allreduce", *(["--gpu"] if use_gpu else [])]
    resnet_args = [
        f"--device={args.device}",
        f"--steps={2 if args.smoke else args.steps}",
        f"--warmup={1 if args.smoke else 10}",
        f"--batch-size={2 if args.smoke else args.batch_size}",
        f"--image-size={64 if args.smoke else 224}",
    ]

    def compare(script: Path, script_args: list[str]) -> dict[str, common.Series]:
        return common.alternate(
            {
                "torchrun": lambda: result_line(
                    common.run_torchrun(script, script_args, nproc=nproc).stdout
                ),
                "ours": lambda: ours(nproc, use_gpu, script, script_args),
            },
            args.repeats,
            warmup=args.warmup,
            check=lambda _name, result: dict(result),
            settle_s=args.settle,
        )

    launch = compare(common.JOBS_SCRIPT, launch_args)
    for name, s in launch.items():
        if any(r["sum"] != nproc * (nproc + 1) / 2 for r in s.extra):
            raise RuntimeError(f"{name}: the all-reduce gave {[r['sum'] for r in s.extra]}")
    launch_median = {name: common.median(s.seconds) for name, s in launch.items()}
    throughput = compare(RESNET, resnet_args)
    ips = {n: common.median([r["images_per_s"] for r in s.extra]) for n, s in throughput.items()}
    walls = {name: common.median(s.seconds) for name, s in throughput.items()}
    first = throughput["torchrun"].extra[0]
    return {
        "environment": environment(use_gpu),
        "nproc": nproc,
        "use_gpu": use_gpu,
        "repeats": args.repeats,
        "launch": {
            "job": "init_process_group + one all_reduce",
            "wall_s": {name: s.seconds for name, s in launch.items()},
            "median_s": launch_median,
            "ratio_ours_to_torchrun": common.ratio(
                launch_median["ours"], launch_median["torchrun"]
            ),
        },
        "throughput": {
            "job": "DDP ResNet-50, synthetic images, bf16 autocast, channels-last, SGD",
            "config": {k: first[k] for k in ("steps", "batch_size", "image_size", "world_size")},
            "parameters": first["parameters"],
            "device": first["device"],
            "images_per_s": {
                n: [r["images_per_s"] for r in s.extra] for n, s in throughput.items()
            },
            "median_images_per_s": ips,
            "ratio_ours_to_torchrun": common.ratio(ips["ours"], ips["torchrun"]),
            "median_wall_s": walls,
            "wall_ratio_ours_to_torchrun": common.ratio(walls["ours"], walls["torchrun"]),
        },
    }


def options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--nproc", type=int, default=0, help="ranks (default: every GPU, or 2)")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (CPU check)")


# -- its section of benchmarks/README.md (run_all.py collects it) --------------------------
TITLE = "GPU"


def render(doc: dict[str, Any]) -> str:
    """The GPU comparison (``gpu_check.sh run``), and how to get it."""
    how = (
        "`bash benchmarks/gpu_check.sh prepare` (here, with network) downloads the cp312 wheels a "
        "GPU machine without Java or pyspark may lack (pendulum, psutil, pytest; about 3 MB) into "
        "`benchmarks/gpu/wheels` (git-ignored); `bash benchmarks/gpu_check.sh run` (on the GPU "
        "machine) installs them into a private directory, runs the GPU tests "
        "(`tests/frameworks/test_gpu.py`: a distinct GPU per rank, the DDP example as function "
        "and script, Lightning, FSDP, a ResNet-50 step) and `benchmarks/gpu/gpu_bench.py`: local "
        "mode with `use_gpu=True` and NCCL vs bare torchrun, launch (one all-reduce) and DDP "
        "ResNet-50 on synthetic 224x224 images, alternating, medians and ratios. It writes "
        "`gpu_bench.json` to `$OUT` (the device tool's folder) or `benchmarks/results/gpu/`; "
        "this page renders `benchmarks/results/gpu/gpu_bench.json` when it is there."
    )
    launch = doc.get("launch", {})
    thr = doc.get("throughput", {})
    lm = launch.get("median_s", {})
    ips = thr.get("median_images_per_s", {})
    walls = thr.get("median_wall_s", {})
    rows = [
        [
            "launch wall s (median)",
            pages.num(lm.get("torchrun")),
            pages.num(lm.get("ours")),
            pages.num(launch.get("ratio_ours_to_torchrun"), 3, "x"),
        ],
        [
            "ResNet-50 images/s (median)",
            pages.num(ips.get("torchrun"), 0),
            pages.num(ips.get("ours"), 0),
            pages.num(thr.get("ratio_ours_to_torchrun"), 3, "x"),
        ],
        [
            "ResNet-50 run wall s (median)",
            pages.num(walls.get("torchrun")),
            pages.num(walls.get("ours")),
            pages.num(thr.get("wall_ratio_ours_to_torchrun"), 3, "x"),
        ],
    ]
    return (
        how + f"\n\n{doc.get('nproc')} rank(s), median of {doc.get('repeats')}, "
        f"config {json.dumps(thr.get('config', {}), sort_keys=True)}:\n\n"
        + pages.table(["figure", "torchrun", "ours", "ours / torchrun"], rows)
    )


BENCH = pages.Benchmark(
    name="gpu_bench",
    title=TITLE,
    measure=measure,
    render=render,
    options=options,
    defaults={"repeats": 3},
    quick=("--device=cpu", "--smoke", "--repeats=1", "--warmup=0"),
    folder="gpu",
)

if __name__ == "__main__":
    sys.exit(common.main(BENCH))
