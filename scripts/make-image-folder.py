"""Writes an ImageNet-style image folder for trying the trainer without a data set at hand:
ROOT/train/<class>/*.png and ROOT/val/<class>/*.png, each class a colour with noise.

    .venv/bin/python scripts/make-image-folder.py ROOT [--classes 4] [--train 64] [--val 16]
                                                       [--size 64]
"""
import argparse
import pathlib

import numpy as np
from PIL import Image


def main():
    p = argparse.ArgumentParser()
    p.add_argument("root")
    p.add_argument("--classes", type=int, default=4)
    p.add_argument("--train", type=int, default=64, help="images per class in train/")
    p.add_argument("--val", type=int, default=16, help="images per class in val/")
    p.add_argument("--size", type=int, default=64)
    a = p.parse_args()
    rng = np.random.default_rng(0)
    colours = rng.integers(0, 256, size=(a.classes, 3))
    for split, count in (("train", a.train), ("val", a.val)):
        for c in range(a.classes):
            folder = pathlib.Path(a.root, split, f"class{c:02d}")
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(count):
                noise = rng.normal(0, 48, size=(a.size, a.size, 3))
                pixels = np.clip(colours[c] + noise, 0, 255).astype(np.uint8)
                Image.fromarray(pixels).save(folder / f"{i:04d}.png")
    print(f"{a.root}: {a.classes} classes, {a.train} + {a.val} images each, {a.size}x{a.size}")


if __name__ == "__main__":
    main()
