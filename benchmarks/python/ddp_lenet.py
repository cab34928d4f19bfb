"""PyTorch's own DistributedDataParallel, written the way the tutorials write it: a LeNet on
Fashion-MNIST, DataLoader + DistributedSampler, the gloo backend, one process per rank started
by torchrun. The peer of `scaletrain bench ddp-vs-python`: same model, data, global batch and
PyTorch version (the project's .venv).

    torchrun --nproc-per-node 2 benchmarks/python/ddp_lenet.py --csv out.csv --steps 40 --repeats 5

Rank 0 appends one row per repetition to --csv: samples per second over --steps steps.
The data are the Debian dataset-fashion-mnist IDX files, read into tensors (torchvision is not
installed here); a TensorDataset stands where the tutorials use torchvision's FashionMNIST.
"""
import argparse
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


class LeNet(nn.Module):
    """Seed 004's LeNet, layer for layer the same as scaletrain's `lenet`."""

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


def read_idx(path):
    with gzip.open(path, "rb") as f:
        data = f.read()
    dims = data[3]
    shape = [int.from_bytes(data[4 + 4 * i: 8 + 4 * i], "big") for i in range(dims)]
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * dims).reshape(shape)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data-dir", default="/usr/share/datasets/fashion-mnist")
    p.add_argument("--batch-size", type=int, default=256, help="global batch")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--csv", required=True)
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
    model = DDP(LeNet())
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)

    def batches():
        epoch = 0
        while True:
            sampler.set_epoch(epoch)
            for b in loader:
                yield b
            epoch += 1

    it = batches()

    def step():
        x, y = next(it)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()

    for _ in range(args.warmup):
        step()
    for _ in range(args.repeats):
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            step()
        dist.barrier()
        rate = args.steps * args.batch_size / (time.perf_counter() - t0)
        if rank == 0:
            with open(args.csv, "a") as f:
                f.write(f"{rate}\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
