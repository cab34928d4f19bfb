"""PyTorch's own Python path on one GPU: the peers of scaletrain's GPU figures (docs/benchmarks.md,
"GPU machine"). Each task runs the model scaletrain's zoo builds, on the same data, batch,
optimizer and PyTorch version, and prints one CSV row per measurement to stdout and --csv.

  resnet18  seed 003: the zoo's small-image ResNet-18 (torchvision's BasicBlock layout, a 3x3
            stride-1 stem, no max-pool) on Fashion-MNIST normalised as scaletrain normalises it,
            batch 256, SGD lr 0.1 without momentum or weight decay, --epochs epochs.
            --loader dataloader: torchvision's FashionMNIST + ToTensor + Normalize in a
            DataLoader (4 workers, shuffled, pinned), as the seed loads it;
            --loader device: the whole set on the GPU, a permutation per epoch (a fast user).
            Rows: epoch, train seconds (the seed's timer: training only), test accuracy.
  resnet50  seed 000's step: torchvision's ResNet-50, 1000 classes, batch 120 of 224x224 random
            images made once, SGD lr 0.001, --steps steps per timed run after a warm-up run.
            --loader dataloader: the batch stays on the CPU and is copied every step, as the
            seed does; --loader device: it is on the GPU. Row: seconds per step.
  gpt       the zoo's gpt2-small (nanoGPT's layout, untied head), --batch-size sequences of
            --context tokens drawn from --data (a uint16 train.bin) on the GPU, Adam lr 3e-4 with
            weight decay 5e-4 (scaletrain's --optimizer adam), bf16 autocast. Row: seconds per
            step and tokens/s over --steps steps after --warmup.

    python3 benchmarks/python/gpu_peer.py resnet18 --loader device --data-dir DIR --csv out.csv
"""
import argparse
import gzip
import os
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ddp_peer import ResNet18Small, read_idx  # noqa: E402  the zoo's model, the IDX reader
from transformer_peer import GPT  # noqa: E402

MEAN, STD = 0.2860, 0.3530  # scaletrain's Fashion-MNIST normalisation (src/data/datasets.cpp)


def sync(a):
    if a.device.startswith("cuda"):
        torch.cuda.synchronize()


def peak_mib(a):
    return torch.cuda.max_memory_allocated() / 2**20 if a.device.startswith("cuda") else 0


def fashion_tensors(data_dir, split):
    prefix = "train" if split == "train" else "t10k"
    x = read_idx(os.path.join(data_dir, f"{prefix}-images-idx3-ubyte.gz"))
    y = read_idx(os.path.join(data_dir, f"{prefix}-labels-idx1-ubyte.gz"))
    x = (torch.from_numpy(x.copy()).float().div_(255).sub_(MEAN).div_(STD)).unsqueeze(1)
    return x, torch.from_numpy(y.astype(np.int64))


def torchvision_loaders(data_dir, batch):
    """The seed's loading: torchvision's FashionMNIST (read from the raw IDX files, unpacked
    under a torchvision-style root), ToTensor and Normalize, a DataLoader of 4 workers."""
    import shutil
    import torchvision
    from torchvision import transforms
    root = "/tmp/gpu_peer_fmnist"
    raw = os.path.join(root, "FashionMNIST", "raw")
    os.makedirs(raw, exist_ok=True)
    for name in ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte",
                 "t10k-labels-idx1-ubyte"):
        if not os.path.exists(os.path.join(raw, name)):
            with gzip.open(os.path.join(data_dir, name + ".gz"), "rb") as f, \
                    open(os.path.join(raw, name), "wb") as g:
                shutil.copyfileobj(f, g)
    t = transforms.Compose([transforms.ToTensor(), transforms.Normalize((MEAN,), (STD,))])
    train = torchvision.datasets.FashionMNIST(root, train=True, transform=t, download=False)
    test = torchvision.datasets.FashionMNIST(root, train=False, transform=t, download=False)
    kw = dict(batch_size=batch, num_workers=4, pin_memory=True)
    return (torch.utils.data.DataLoader(train, shuffle=True, **kw),
            torch.utils.data.DataLoader(test, shuffle=False, **kw))


def resnet18(a, emit):
    dev = torch.device(a.device)
    torch.manual_seed(a.seed)
    model = ResNet18Small().to(dev)
    fmt = torch.channels_last if a.channels_last else torch.contiguous_format
    model = model.to(memory_format=fmt)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp = a.amp == "bf16"
    if a.loader == "dataloader":
        train_iter, test_iter = torchvision_loaders(a.data_dir, a.batch_size)
    else:
        xtr, ytr = (t[:a.limit or None].to(dev) for t in fashion_tensors(a.data_dir, "train"))
        xte, yte = (t.to(dev) for t in fashion_tensors(a.data_dir, "test"))
        gen = torch.Generator(device=dev)
        gen.manual_seed(a.seed)

        def train_iter_fn():
            order = torch.randperm(xtr.shape[0], device=dev, generator=gen)
            for i in range(0, xtr.shape[0], a.batch_size):
                idx = order[i:i + a.batch_size]
                yield xtr[idx], ytr[idx]

        test_iter = [(xte[i:i + 1000], yte[i:i + 1000]) for i in range(0, xte.shape[0], 1000)]
    for epoch in range(a.epochs):
        model.train()
        sync(a)
        t0 = time.perf_counter()
        n = 0
        batches = train_iter if a.loader == "dataloader" else train_iter_fn()
        for x, y in batches:
            x = x.to(dev, non_blocking=True).contiguous(memory_format=fmt)
            y = y.to(dev, non_blocking=True)
            opt.zero_grad(set_to_none=True)
            with torch.autocast(dev.type, torch.bfloat16, enabled=amp):
                out = model(x)
            loss = F.cross_entropy(out.float(), y)
            loss.backward()
            opt.step()
            if a.sync_each_step:
                loss.item()
            n += y.shape[0]
        sync(a)
        seconds = time.perf_counter() - t0
        model.eval()
        correct = total = 0
        with torch.no_grad(), torch.autocast(dev.type, torch.bfloat16, enabled=amp):
            for x, y in test_iter:
                x = x.to(dev, non_blocking=True).contiguous(memory_format=fmt)
                y = y.to(dev, non_blocking=True)
                correct += (model(x).argmax(1) == y).sum().item()
                total += y.shape[0]
        emit(f"resnet18,{a.loader},{a.amp},{int(a.channels_last)},{int(a.sync_each_step)},"
             f"{epoch + 1},{seconds:.4f},{n / seconds:.1f},{correct / total:.4f}")


def resnet50(a, emit):
    import torchvision
    dev = torch.device(a.device)
    torch.manual_seed(a.seed)
    model = torchvision.models.resnet50(num_classes=1000).to(dev)
    fmt = torch.channels_last if a.channels_last else torch.contiguous_format
    model = model.to(memory_format=fmt)
    opt = torch.optim.SGD(model.parameters(), lr=0.001)
    x_cpu = torch.randn(a.batch_size, 3, 224, 224)
    y_cpu = torch.randint(1000, (a.batch_size,))
    if a.loader == "device":
        x_cpu, y_cpu = x_cpu.to(dev), y_cpu.to(dev)

    def run():
        for _ in range(a.steps):
            x = x_cpu.to(dev).contiguous(memory_format=fmt)
            y = y_cpu.to(dev)
            opt.zero_grad()
            with torch.autocast(dev.type, torch.bfloat16, enabled=a.amp == "bf16"):
                out = model(x)
            F.cross_entropy(out.float(), y).backward()
            opt.step()
        sync(a)

    run()
    for r in range(a.repeats):
        t0 = time.perf_counter()
        run()
        per_step = (time.perf_counter() - t0) / a.steps
        emit(f"resnet50,{a.loader},{a.amp},{int(a.channels_last)},{r},{per_step:.5f},"
             f"{a.batch_size / per_step:.1f}")


def gpt(a, emit):
    dev = torch.device(a.device)
    torch.manual_seed(a.seed)
    model = GPT(50257, a.context, 12, 12, 768).to(dev)
    positions = torch.arange(a.context, device=dev)

    def forward(ids):  # transformer_peer's forward, with the positions on the GPU
        t = model.transformer
        x = t.wte(ids) + t.wpe(positions[:ids.shape[1]])
        for block in t.h:
            x = block(x)
        return model.lm_head(t.ln_f(x))

    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.Adam(model.parameters(), lr=3e-4, weight_decay=5e-4)
    tokens = torch.from_numpy(np.fromfile(a.data, dtype=np.uint16).astype(np.int64)).to(dev)
    gen = torch.Generator(device=dev)
    gen.manual_seed(a.seed)

    def step():
        start = torch.randint(tokens.numel() - a.context - 1, (a.batch_size,), device=dev,
                              generator=gen)
        idx = start[:, None] + torch.arange(a.context + 1, device=dev)
        w = tokens[idx]
        opt.zero_grad(set_to_none=True)
        with torch.autocast(dev.type, torch.bfloat16):
            logits = forward(w[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), w[:, 1:].flatten())
        loss.backward()
        opt.step()
        return loss

    for _ in range(a.warmup):
        step()
    sync(a)
    t0 = time.perf_counter()
    for _ in range(a.steps):
        loss = step()
    sync(a)
    per_step = (time.perf_counter() - t0) / a.steps
    tok = a.batch_size * a.context / per_step
    mfu = 6 * params * tok / a.peak_flops
    emit(f"gpt2-small,{params},{a.batch_size},{a.context},{per_step:.5f},{tok:.0f},{mfu:.4f},"
         f"{loss.item():.4f},{peak_mib(a):.0f}")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("task", choices=["resnet18", "resnet50", "gpt"])
    p.add_argument("--data-dir", default="/usr/share/datasets/fashion-mnist")
    p.add_argument("--data", default="", help="gpt: a uint16 train.bin")
    p.add_argument("--loader", choices=["dataloader", "device"], default="device")
    p.add_argument("--amp", choices=["none", "bf16"], default="none")
    p.add_argument("--channels-last", type=int, default=1)
    p.add_argument("--sync-each-step", type=int, default=0, help="resnet18: loss.item() per step")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=0, help="0: the task's (256, 120, 8)")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--steps", type=int, default=0, help="0: the task's (3, 3, 50)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--peak-flops", type=float, default=989e12)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda")
    p.add_argument("--cudnn-benchmark", type=int, default=0, help="1: cuDNN picks by timing")
    p.add_argument("--limit", type=int, default=0, help="resnet18: first N training samples")
    p.add_argument("--csv", default="")
    a = p.parse_args()
    a.batch_size = a.batch_size or {"resnet18": 256, "resnet50": 120, "gpt": 8}[a.task]
    a.steps = a.steps or {"resnet18": 0, "resnet50": 3, "gpt": 50}[a.task]
    headers = {
        "resnet18": "task,loader,amp,channels_last,sync_each_step,epoch,seconds,samples_per_s,"
                    "test_accuracy",
        "resnet50": "task,loader,amp,channels_last,repeat,seconds_per_step,samples_per_s",
        "gpt": "task,params,batch,context,seconds_per_step,tokens_per_s,mfu,last_loss,"
               "peak_mib",
    }
    torch.backends.cudnn.benchmark = bool(a.cudnn_benchmark)
    name = torch.cuda.get_device_name(0) if a.device.startswith("cuda") else "cpu"
    print(f"# {torch.__version__} {name}", flush=True)
    new = a.csv and not os.path.exists(a.csv)
    out = open(a.csv, "a") if a.csv else None
    if new:
        out.write(headers[a.task] + "\n")
    print(headers[a.task], flush=True)

    def emit(row):
        print(row, flush=True)
        if out:
            out.write(row + "\n")
            out.flush()

    {"resnet18": resnet18, "resnet50": resnet50, "gpt": gpt}[a.task](a, emit)


if __name__ == "__main__":
    main()
