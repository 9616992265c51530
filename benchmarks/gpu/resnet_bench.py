"""DDP ResNet-50 on synthetic 224x224 images: a torchrun script that measures images/s.

    torchrun --nproc-per-node=1 benchmarks/gpu/resnet_bench.py --steps 50
    python -c "from sparktorch_ops import TorchDistributor as T; \\
        print(T(1, True, True).run('benchmarks/gpu/resnet_bench.py', '--steps=50'))"

The model is ResNet-50 as torchvision defines it (bottleneck blocks [3, 4, 6, 3], 25,557,032
parameters), written out here because the GPU machine has no torchvision. Timing is rank 0's
wall time over the measured steps after warm-up, with the device synchronised at both ends;
rank 0 prints one ``RESULT {json}`` line. On CPU (``--device cpu``, gloo) it runs as a smoke
test with tiny sizes.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

RESNET50_PARAMETERS = 25_557_032


class Bottleneck(nn.Module):
    """torchvision's Bottleneck (stride on the 3x3 convolution, "ResNet v1.5")."""

    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        width = planes
        self.conv1 = nn.Conv2d(inplanes, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, planes * self.expansion, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(planes * self.expansion)
        self.downsample: nn.Module | None = None
        if stride != 1 or inplanes != planes * self.expansion:
            self.downsample = nn.Sequential(
                nn.Conv2d(inplanes, planes * self.expansion, 1, stride=stride, bias=False),
                nn.BatchNorm2d(planes * self.expansion),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = F.relu(self.bn1(self.conv1(x)))
        out = F.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return F.relu(out + identity)


class ResNet50(nn.Module):
    """ResNet-50 for ImageNet-sized inputs (1000 classes)."""

    def __init__(self, num_classes: int = 1000) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        layers: list[nn.Module] = []
        inplanes = 64
        for planes, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
            for index in range(blocks):
                layers.append(Bottleneck(inplanes, planes, stride if index == 0 else 1))
                inplanes = planes * Bottleneck.expansion
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(512 * Bottleneck.expansion, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 3, stride=2, padding=1)
        x = self.layers(x)
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def benchmark(
    steps: int = 50,
    warmup: int = 10,
    batch_size: int = 128,
    image_size: int = 224,
    device_kind: str = "cuda",
) -> dict[str, Any]:
    """Train DDP ResNet-50 on one fixed synthetic batch per rank; rank 0's timing."""
    started = time.perf_counter()
    use_cuda = device_kind == "cuda"
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if use_cuda:
        torch.cuda.set_device(local_rank)
        torch.backends.cudnn.benchmark = True
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    dist.init_process_group("nccl" if use_cuda else "gloo")
    try:
        torch.manual_seed(0)
        model = ResNet50().to(device)
        model = model.to(memory_format=torch.channels_last)  # type: ignore[call-overload]
        ddp = nn.parallel.DistributedDataParallel(
            model, device_ids=[local_rank] if use_cuda else None
        )
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
        images = torch.randn(batch_size, 3, image_size, image_size, device=device)
        images = images.contiguous(memory_format=torch.channels_last)
        labels = torch.randint(0, 1000, (batch_size,), device=device)

        def step() -> None:
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_cuda):
                loss = F.cross_entropy(ddp(images), labels)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        for _ in range(warmup):
            step()
        if use_cuda:
            torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        if use_cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        world = dist.get_world_size()
        return {
            "images_per_s": steps * batch_size * world / seconds,
            "measured_s": seconds,
            "steps": steps,
            "batch_size": batch_size,
            "image_size": image_size,
            "world_size": world,
            "parameters": sum(p.numel() for p in model.parameters()),
            "device": torch.cuda.get_device_name(device) if use_cuda else "cpu",
            "setup_s": t0 - started,
        }
    finally:
        dist.destroy_process_group()


def main() -> None:
    """Command line: run the benchmark; rank 0 prints ``RESULT {json}``."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    args = parser.parse_args()
    result = benchmark(args.steps, args.warmup, args.batch_size, args.image_size, args.device)
    if int(os.environ.get("RANK", "0")) == 0:
        print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
