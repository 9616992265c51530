"""GPU launch and throughput: ours (local mode, ``use_gpu=True``, NCCL) vs bare torchrun.

    python benchmarks/gpu/gpu_bench.py --out benchmarks/results/gpu          # on the GPU machine
    python benchmarks/gpu/gpu_bench.py --device cpu --smoke --out /tmp/g     # a CPU smoke run

Variants alternate round by round, the order rotated each round (drift hits all alike):

- launch: ``allreduce.py`` (init NCCL, all-reduce one tensor) as bare ``torchrun``, through
  ``TorchDistributor.run(script)``; wall time from the driver's call to its return.
- throughput: ``resnet_bench.py`` (DDP ResNet-50, synthetic 224x224 images, bf16 autocast,
  channels-last) the same two ways; images/s as rank 0 measured it, and the wall time.

Needs no Spark and no Java: local mode only. Writes ``gpu_bench.json`` into ``--out`` and
prints a table of medians and ratios (ours / torchrun).
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
ALLREDUCE = HERE / "allreduce.py"
RESNET = HERE / "resnet_bench.py"
#: Where run_all.py finds this benchmark's result, under benchmarks/results/ (gpu_check.sh).
RESULT = Path("gpu") / "gpu_bench.json"


def _result_line(text: str) -> dict[str, Any]:
    for line in reversed(text.splitlines()):
        if "RESULT {" in line:
            parsed: dict[str, Any] = json.loads(line[line.index("RESULT {") + len("RESULT ") :])
            return parsed
    raise RuntimeError(f"no RESULT line in the output:\n{text[-3000:]}")


def bare_torchrun(nproc: int, script: Path, args: list[str]) -> tuple[float, dict[str, Any]]:
    """Run ``torchrun --nproc-per-node=N script args``; (wall seconds, rank 0's RESULT)."""
    started = time.perf_counter()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc-per-node={nproc}",
            str(script),
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=600,
        stdin=subprocess.DEVNULL,
    )
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        raise RuntimeError(f"torchrun exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return wall, _result_line(proc.stdout)


def ours(nproc: int, use_gpu: bool, script: Path, args: list[str]) -> tuple[float, dict[str, Any]]:
    """Run the script through TorchDistributor in local mode; (wall seconds, RESULT)."""
    from sparktorch_ops.distributor import TorchDistributor

    quiet = logging.getLogger("gpu_bench.ranks")
    quiet.propagate = False
    quiet.addHandler(logging.NullHandler())
    started = time.perf_counter()
    output = TorchDistributor(
        num_processes=nproc, local_mode=True, use_gpu=use_gpu, logger=quiet
    ).run(str(script), *args)
    return time.perf_counter() - started, _result_line(output)


def alternate(
    repeats: int, variants: dict[str, Any], log: logging.Logger
) -> dict[str, list[tuple[float, dict[str, Any]]]]:
    """One warm-up round (discarded), then ``repeats`` rounds with the order rotated."""
    names = list(variants)
    samples: dict[str, list[tuple[float, dict[str, Any]]]] = {name: [] for name in names}
    for round_index in range(repeats + 1):
        order = names[round_index % len(names) :] + names[: round_index % len(names)]
        for name in order:
            wall, result = variants[name]()
            log.info("round %d %-10s %.2f s %s", round_index, name, wall, result)
            if round_index > 0:
                samples[name].append((wall, result))
    return samples


def _nccl_version() -> str:
    import torch

    version = torch.cuda.nccl.version()
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def _environment(device: str) -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "time": datetime.datetime.now(datetime.UTC).isoformat(),
    }
    if device == "cuda":
        info.update(
            cuda=torch.version.cuda,
            nccl=_nccl_version(),
            gpus=[torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        )
    return info


def main() -> None:
    """Run both comparisons; write the JSON; print the table."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "gpu"))
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--nproc", type=int, default=0, help="ranks (default: every GPU, or 2)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (CPU check)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    log = logging.getLogger("gpu_bench")
    os.environ.pop("PYTHONUNBUFFERED", None)  # ranks get the default buffering, as users do

    import torch

    use_gpu = args.device == "cuda"
    if use_gpu and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: pass --device cpu for a smoke run")
    nproc = args.nproc or (torch.cuda.device_count() if use_gpu else 2)
    device_args = [f"--device={args.device}"]
    resnet_args = [
        *device_args,
        f"--steps={2 if args.smoke else args.steps}",
        f"--warmup={1 if args.smoke else 10}",
        f"--batch-size={2 if args.smoke else args.batch_size}",
        f"--image-size={64 if args.smoke else 224}",
    ]
    report: dict[str, Any] = {
        "environment": _environment(args.device),
        "nproc": nproc,
        "use_gpu": use_gpu,
        "repeats": args.repeats,
    }

    launch = alternate(
        args.repeats,
        {
            "torchrun": lambda: bare_torchrun(nproc, ALLREDUCE, device_args),
            "ours": lambda: ours(nproc, use_gpu, ALLREDUCE, device_args),
        },
        log,
    )
    for name, runs in launch.items():
        for _, result in runs:
            if result["sum"] != nproc:
                raise RuntimeError(f"{name}: all-reduce gave {result['sum']}, expected {nproc}")
    launch_median = {name: statistics.median(w for w, _ in runs) for name, runs in launch.items()}
    report["launch"] = {
        "job": "init_process_group + one all_reduce",
        "wall_s": {name: [w for w, _ in runs] for name, runs in launch.items()},
        "median_s": launch_median,
        "ratio_ours_to_torchrun": launch_median["ours"] / launch_median["torchrun"],
    }

    throughput = alternate(
        args.repeats,
        {
            "torchrun": lambda: bare_torchrun(nproc, RESNET, resnet_args),
            "ours": lambda: ours(nproc, use_gpu, RESNET, resnet_args),
        },
        log,
    )
    ips = {
        name: statistics.median(r["images_per_s"] for _, r in runs)
        for name, runs in throughput.items()
    }
    walls = {name: statistics.median(w for w, _ in runs) for name, runs in throughput.items()}
    first = throughput["torchrun"][0][1]
    report["throughput"] = {
        "job": "DDP ResNet-50, synthetic images, bf16 autocast, channels-last, SGD",
        "config": {k: first[k] for k in ("steps", "batch_size", "image_size", "world_size")},
        "parameters": first["parameters"],
        "device": first["device"],
        "images_per_s": {n: [r["images_per_s"] for _, r in runs] for n, runs in throughput.items()},
        "median_images_per_s": ips,
        "ratio_ours_to_torchrun": ips["ours"] / ips["torchrun"],
        "median_wall_s": walls,
        "wall_ratio_ours_to_torchrun": walls["ours"] / walls["torchrun"],
    }

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_bench.json").write_text(json.dumps(report, indent=2) + "\n")
    rows = [
        ("launch wall s (median)", launch_median["torchrun"], launch_median["ours"]),
        ("ResNet-50 images/s (median)", ips["torchrun"], ips["ours"]),
        ("ResNet-50 run wall s (median)", walls["torchrun"], walls["ours"]),
    ]
    print(f"\n{'':32}{'torchrun':>12}{'ours':>12}{'ours/torchrun':>15}")
    for label, bare, mine in rows:
        print(f"{label:32}{bare:12.2f}{mine:12.2f}{mine / bare:15.3f}")
    print(f"\n{nproc} rank(s), device {first['device']}; JSON: {out / 'gpu_bench.json'}")


# -- its section of benchmarks/README.md (run_all.py collects it) --------------------------
TITLE = "GPU"


def render(doc: dict[str, Any] | None) -> str:
    """The GPU comparison (``gpu_check.sh run``), or how to get it when there is none yet."""
    import pages  # benchmarks/, on the path of run_all.py, which renders this

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
        f"this page renders `benchmarks/results/{RESULT.as_posix()}` when it is there."
    )
    if doc is None:
        return f"{how}\n\n**Not run yet**: there is no `benchmarks/results/{RESULT.as_posix()}`."
    env = doc.get("environment", {})
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
    gpus = ", ".join(env.get("gpus") or []) or env.get("machine", "-")
    return (
        how + f"\n\n{doc.get('nproc')} rank(s), median of {doc.get('repeats')}, "
        f"config {json.dumps(thr.get('config', {}), sort_keys=True)}:\n\n"
        + pages.table(["figure", "torchrun", "ours", "ours / torchrun"], rows)
        + f"\n\n*{gpus}; {env.get('cpus')} CPUs; Python {env.get('python')}, torch "
        f"{env.get('torch')}, CUDA {env.get('cuda')}, NCCL {env.get('nccl')}; {env.get('time')}*"
    )


if __name__ == "__main__":
    main()
