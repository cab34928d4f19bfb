"""The same program in Python with PyTorch's own DDP, for comparison (docs/library.md):
torchrun --nproc-per-node 2 examples/ddp/ddp_example.py runs/x"""
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(20, 64), torch.nn.Linear(64, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else "runs/ddp_example_py"
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    x = torch.randn(2048, 20)
    y = (x @ torch.randn(20, 4)).argmax(1)
    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    start, path = 0, os.path.join(out, "checkpoint.pt")
    if os.path.exists(path):
        state = torch.load(path)
        net.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        start = state["epoch"]
    ddp = DistributedDataParallel(net)
    sampler = DistributedSampler(TensorDataset(x, y))
    loader = DataLoader(TensorDataset(x, y), batch_size=64 // dist.get_world_size(), sampler=sampler)
    for epoch in range(start, 4):
        sampler.set_epoch(epoch)
        for xb, yb in loader:
            opt.zero_grad()
            loss = F.cross_entropy(ddp(xb), yb)
            loss.backward()
            opt.step()
        if dist.get_rank() == 0:
            os.makedirs(out, exist_ok=True)
            torch.save({"model": net.state_dict(), "optimizer": opt.state_dict(), "epoch": epoch + 1},
                       path)
        dist.barrier()
        if dist.get_rank() == 0:
            print(f"epoch {epoch + 1} loss {loss.item()}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
