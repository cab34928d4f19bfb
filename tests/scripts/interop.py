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
from safetensors.torch import load_file, save_file

# The seeds' models as the Python DDP benchmark defines them: one definition for both.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "python"))
from ddp_peer import LeNet, ResNet18Small  # noqa: E402

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
