"""The Python side of the weights interop test: the seeds' LeNet and small-image ResNet-18
written in plain PyTorch, loading weights scaletrain saved, and saving weights for it.

  interop.py run MODEL WEIGHTS IO OUT  load WEIGHTS (strict), save {"x", "y": MODEL(IO["x"])} to OUT
  interop.py make MODEL WEIGHTS IO     save a fresh MODEL's state_dict and {"x", "y"} for C++

The C++ side compares both sides' outputs with the exact (float64) values and the bound of
their arithmetic (Note [Tolerances] in tests/support/tolerance.h).

WEIGHTS ending in .safetensors use safetensors; others torch.save / torch.load (weights_only,
its default).
"""
import pathlib
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

# The seed's LeNet as the Python DDP benchmark defines it: one definition for both.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "python"))
from ddp_lenet import LeNet  # noqa: E402


class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        h = F.relu(self.bn1(self.conv1(x)))
        h = self.bn2(self.conv2(h))
        return F.relu(h + (self.downsample(x) if self.downsample is not None else x))


class ResNet18Small(nn.Module):
    """Seed 003's ResNet-18: 3x3 stride-1 stem, no max-pool."""

    def __init__(self, in_channels=1, num_classes=10):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, 64, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        cin, layers = 64, []
        for i, width in enumerate([64, 128, 256, 512]):
            stride = 1 if i == 0 else 2
            layers.append(nn.Sequential(BasicBlock(cin, width, stride), BasicBlock(width, width, 1)))
            cin = width
        self.layer1, self.layer2, self.layer3, self.layer4 = layers
        self.fc = nn.Linear(512, num_classes)

    def forward(self, x):
        h = F.relu(self.bn1(self.conv1(x)))
        for layer in (self.layer1, self.layer2, self.layer3, self.layer4):
            h = layer(h)
        return self.fc(h.mean((2, 3)))


MODELS = {"lenet": LeNet, "resnet18": ResNet18Small}


def main():
    mode, name, weights, io_path = sys.argv[1:5]
    torch.set_num_threads(1)
    model = MODELS[name]()
    if mode == "run":
        state = load_file(weights) if weights.endswith(".safetensors") else torch.load(weights)
        model.load_state_dict(state, strict=True)
        model.eval()
        io = torch.load(io_path, weights_only=False)  # test data: written by torch::pickle_save
        with torch.no_grad():
            y = model(io["x"])
        torch.save({"x": io["x"], "y": y}, sys.argv[5])
        print(f"{name}: output {tuple(y.shape)} saved")
        return
    torch.manual_seed(7)
    model = MODELS[name]()
    x = torch.randn(4, 1, 28, 28)
    model.train()
    with torch.no_grad():
        model(x * 2 + 1)  # moves the batch-norm running statistics off their defaults
    model.eval()
    with torch.no_grad():
        y = model(x)
    if weights.endswith(".safetensors"):
        save_file(model.state_dict(), weights)
    else:
        torch.save(dict(model.state_dict()), weights)
    torch.save({"x": x, "y": y}, io_path)
    print(f"{name}: saved {len(model.state_dict())} tensors")


if __name__ == "__main__":
    main()
