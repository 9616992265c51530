"""The trivial launch job: init the process group, all-reduce one tensor, exit.

    torchrun --nproc-per-node=1 benchmarks/gpu/allreduce.py [--device cpu]

Rank 0 prints ``RESULT {json}`` with the reduced value (the world size).
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist


def main() -> None:
    """All-reduce a one; NCCL on the rank's GPU, or gloo with ``--device cpu``."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    args = parser.parse_args()
    use_cuda = args.device == "cuda"
    if use_cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if use_cuda else "gloo")
    value = torch.ones(1, device="cuda" if use_cuda else "cpu")
    dist.all_reduce(value)
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps({"sum": float(value.item())}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
