"""PyTorch's own DistributedDataParallel, written the way the tutorials write it: a model on
Fashion-MNIST, DataLoader + DistributedSampler, the gloo backend, one process per rank started
by torchrun. The peer of `scaletrain bench ddp-vs-python`: the same model definitions as
scaletrain's zoo without its model-level optimisations (`ModelOptions::model_optimizations =
false`: LibTorch's conv, relu and avg_pool2d, layer for layer these), the same data, global
batch, optimizer and PyTorch version (the project's .venv).

    torchrun --nproc-per-node 2 benchmarks/python/ddp_peer.py --model lenet --channels-last 1 \
        --csv out.csv --steps 40 --repeats 5 [--phases phases.csv]

Rank 0 appends one row per repetition to --csv: samples per second over --steps steps. With
--phases, rank 0 writes where a step's time went (milliseconds per step: data, forward,
backward, step) and, from --steps more steps under no_sync(), backward without communication.
The data are the Debian dataset-fashion-mnist IDX files, read into tensors (torchvision is not
installed here); a TensorDataset stands where the tutorials use torchvision's FashionMNIST.
"""
import argparse
import contextlib
import gzip
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


class MLP(nn.Module):
    """scaletrain's `mlp`: 784 -> 256 -> ReLU -> 10."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(784, 256)
        self.fc2 = nn.Linear(256, 10)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


class LeNet(nn.Module):
    """Seed 004's LeNet, scaletrain's `lenet` without model optimisations."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 20, 3)
        self.conv2 = nn.Conv2d(20, 50, 5)
        self.fc1 = nn.Linear(800, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = F.avg_pool2d(F.relu(self.conv1(x)), 2)
        x = F.avg_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                            nn.BatchNorm2d(cout))

    def forward(self, x):
        h = F.relu(self.bn1(self.conv1(x)))
        h = self.bn2(self.conv2(h))
        return F.relu(h + (self.downsample(x) if self.downsample is not None else x))


class ResNet18Small(nn.Module):
    """Seed 003's small-image ResNet-18 (3x3 stride-1 stem, no max-pool), scaletrain's
    `resnet18` without model optimisations."""

    def __init__(self, in_channels=1, num_classes=10):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, 64, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        layers, cin = [], 64
        for i, w in enumerate([64, 128, 256, 512]):
            layers.append(nn.Sequential(BasicBlock(cin, w, 1 if i == 0 else 2),
                                        BasicBlock(w, w, 1)))
            cin = w
        self.layer1, self.layer2, self.layer3, self.layer4 = layers
        self.fc = nn.Linear(512, num_classes)

    def forward(self, x):
        h = F.relu(self.bn1(self.conv1(x)))
        for layer in (self.layer1, self.layer2, self.layer3, self.layer4):
            h = layer(h)
        return self.fc(h.mean((2, 3)))


MODELS = {"mlp": MLP, "lenet": LeNet, "resnet18": ResNet18Small}


def read_idx(path):
    with gzip.open(path, "rb") as f:
        data = f.read()
    dims = data[3]
    shape = [int.from_bytes(data[4 + 4 * i: 8 + 4 * i], "big") for i in range(dims)]
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * dims).reshape(shape)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data-dir", default="/usr/share/datasets/fashion-mnist")
    p.add_argument("--model", default="lenet", choices=sorted(MODELS))
    p.add_argument("--channels-last", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=256, help="global batch")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--csv", required=True)
    p.add_argument("--phases", default="")
    args = p.parse_args()

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    images = torch.from_numpy(read_idx(f"{args.data_dir}/train-images-idx3-ubyte.gz").copy())
    labels = torch.from_numpy(read_idx(f"{args.data_dir}/train-labels-idx1-ubyte.gz").copy())
    images = ((images.float() / 255 - 0.2860) / 0.3530).unsqueeze(1)
    dataset = TensorDataset(images, labels.long())
    sampler = DistributedSampler(dataset, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=args.batch_size // world, sampler=sampler)

    torch.manual_seed(0)
    model = MODELS[args.model]()
    memory_format = torch.channels_last if args.channels_last else torch.contiguous_format
    if args.channels_last:
        model = model.to(memory_format=torch.channels_last)
    model = DDP(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)

    def batches():
        epoch = 0
        while True:
            sampler.set_epoch(epoch)
            for b in loader:
                yield b
            epoch += 1

    it = batches()
    phases = {"data": 0.0, "forward": 0.0, "backward": 0.0, "step": 0.0}

    def step(ph):
        t0 = time.perf_counter()
        x, y = next(it)
        x = x.contiguous(memory_format=memory_format)
        t1 = time.perf_counter()
        loss = F.cross_entropy(model(x), y)
        t2 = time.perf_counter()
        loss.backward()
        t3 = time.perf_counter()
        opt.step()
        opt.zero_grad()
        t4 = time.perf_counter()
        if ph is not None:
            ph["data"] += t1 - t0
            ph["forward"] += t2 - t1
            ph["backward"] += t3 - t2
            ph["step"] += t4 - t3

    for _ in range(args.warmup):
        step(None)
    for _ in range(args.repeats):
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            step(phases)
        dist.barrier()
        rate = args.steps * args.batch_size / (time.perf_counter() - t0)
        if rank == 0:
            with open(args.csv, "a") as f:
                f.write(f"{rate}\n")
    if args.phases:
        # The same steps without gradient synchronisation: backward alone, so that
        # communication (what DDP adds to backward) is the difference.
        local = {"data": 0.0, "forward": 0.0, "backward": 0.0, "step": 0.0}
        with model.no_sync() if world > 1 else contextlib.nullcontext():
            for _ in range(args.steps):
                step(local)
        dist.barrier()
        if rank == 0:
            n = args.steps * args.repeats
            with open(args.phases, "w") as f:
                for k in ("data", "forward", "backward", "step"):
                    f.write(f"{k},{1e3 * phases[k] / n}\n")
                f.write(f"backward_local,{1e3 * local['backward'] / args.steps}\n")
    dist.barrier()  # every rank past its last collective before Gloo is torn down
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
