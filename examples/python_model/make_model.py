"""Writes the example's model: a classifier of 2-D points, defined in Python, saved as TorchScript.

    python make_model.py spirals.pt
"""
import sys

import torch
import torch.nn as nn

model = nn.Sequential(nn.Linear(2, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 2))
torch.jit.save(torch.jit.script(model), sys.argv[1])
