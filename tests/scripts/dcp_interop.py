"""The Python side of the distributed checkpoint test (tests/distributed_checkpoint_test.cpp):
PyTorch's own torch.distributed.checkpoint reading folders scaletrain wrote, and writing
folders for scaletrain to read.

  dcp_interop.py check DIR REF OUT  dcp.load DIR into a plain model's state dict and compare
                                    with REF's tensors (bit for bit); dcp_to_torch_save DIR to
                                    OUT and compare again, with the values
  dcp_interop.py check-dtensor DIR REF  the same into DTensors split along their last dimension
                                    over 2 processes (gloo)
  dcp_interop.py save DIR REF       dcp.save from 2 processes (gloo): DTensors split by rows,
                                    by columns (unevenly) and replicated; REF: the whole tensors
  dcp_interop.py lenet NESTED PLAIN PT  a LeNet's weights as dcp.save({"model": sd}), as
                                    dcp.save(sd) and as torch.save(dict(sd))
  dcp_interop.py foreign DIR        DIR/.metadata again with a datetime.date in its planner data
  dcp_interop.py optim-load DIR REF  get_state_dict() of a model and Adam, dcp.load of DIR into
                                    it, set_state_dict(), compared with REF; then a step runs
  dcp_interop.py optim-save DIR REF  3 Adam steps, dcp.save of get_state_dict(); REF: its tensors
  dcp_interop.py trainer DIR PT     a trainer's checkpoint folder (--checkpoint-format dcp):
                                    dcp_to_torch_save's model and dcp.load's are PT's weights
                                    (scaletrain's model.pt); says what its optimizer and
                                    training state hold

REF files of the C++ side are torch::pickle_save'd dicts of tensors.
"""
import datetime
import os
import pathlib
import pickle
import sys
import tempfile
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

warnings.filterwarnings("ignore")  # dcp.load without a process group says it assumes one process


def fail(msg):
    print("MISMATCH: " + msg)
    sys.exit(1)


def same(name, got, want):
    if got.dtype != want.dtype or got.shape != want.shape or not torch.equal(got, want):
        fail(f"{name}: got {got.dtype} {tuple(got.shape)} {got.flatten()[:6].tolist()}, "
             f"want {want.dtype} {tuple(want.shape)} {want.flatten()[:6].tolist()}")


def check(folder, ref_path, out):
    ref = torch.load(ref_path, weights_only=False)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 4),
                                torch.nn.Linear(4, 6))
    state = {"model": model.state_dict(), "epoch": 0, "name": "", "betas": ()}
    dcp.load(state, checkpoint_id=folder)
    model.load_state_dict(state["model"])
    for key, value in model.state_dict().items():
        same("model." + key, value, ref["model." + key])
    values = {"epoch": 3, "name": "lenet/run-1", "betas": (0.9, 0.999)}
    for key, want in values.items():
        if state[key] != want:
            fail(f"dcp.load gave {key} = {state[key]!r}, want {want!r}")
    dcp_to_torch_save(folder, out)
    whole = torch.load(out, weights_only=False)
    for key, value in ref.items():
        top, rest = key.split(".", 1) if key.startswith("model.") else (key, None)
        same(key, whole[top][rest] if rest else whole[top], value)
    for key, want in values.items():
        if whole[key] != want:
            fail(f"dcp_to_torch_save gave {key} = {whole[key]!r}, want {want!r}")
    print(f"dcp.load and dcp_to_torch_save: {len(ref)} tensors and {len(values)} values equal")


def dtensor_rank(rank, folder, ref_path, store):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=2)
    ref = torch.load(ref_path, weights_only=False)
    mesh = init_device_mesh("cpu", (2,))
    # Each tensor split along its last dimension, another layout than the one saved.
    state = {k: distribute_tensor(torch.zeros_like(v), mesh, [Shard(v.dim() - 1)])
             for k, v in ref.items()}
    dcp.load(state, checkpoint_id=folder)
    for key, value in state.items():
        same(key + " (DTensor)", value.full_tensor(), ref[key])
    # Both ranks past their last collective, then out without tearing Gloo down: a rank that
    # closed its pairs while the other still read from them aborted the other (SIGABRT, 1 run
    # in 4), and with a barrier before destroy_process_group() one run of a fresh clone's suite
    # still aborted in the teardown ("terminate called without an active exception").
    # Regression (PythonRankAbortedAtTeardown): everything is checked by now, so the rank leaves
    # at once with status 0, which mp.spawn takes as success.
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def check_dtensor(folder, ref_path):
    import torch.multiprocessing as mp

    store = os.path.join(tempfile.mkdtemp(), "store")
    mp.spawn(dtensor_rank, args=(folder, ref_path, store), nprocs=2)
    print("dcp.load into DTensors over 2 processes: equal")


def full_tensors():
    g = torch.Generator().manual_seed(5)
    return {
        "model.w": torch.randn(5, 6, generator=g),  # rows 3 + 2
        "model.v": torch.randn(4, 5, generator=g),  # columns 3 + 2
        "model.b": torch.randn(6, generator=g),  # on both ranks: saved once
        "model.h": torch.randn(3, 4, generator=g).to(torch.bfloat16),  # rows 2 + 1
        "step": torch.tensor(7, dtype=torch.int64),
    }


def save_rank(rank, folder, store):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    t = full_tensors()
    placement = {"model.w": Shard(0), "model.v": Shard(1), "model.b": Replicate(),
                 "model.h": Shard(0)}
    model = {k.split(".", 1)[1]: distribute_tensor(t[k], mesh, [p]) for k, p in placement.items()}
    dcp.save({"model": model, "step": t["step"]}, checkpoint_id=folder)
    # Both ranks past their last collective, then out without tearing Gloo down: a rank that
    # closed its pairs while the other still read from them aborted the other (SIGABRT, 1 run
    # in 4), and with a barrier before destroy_process_group() one run of a fresh clone's suite
    # still aborted in the teardown ("terminate called without an active exception").
    # Regression (PythonRankAbortedAtTeardown): everything is checked by now, so the rank leaves
    # at once with status 0, which mp.spawn takes as success.
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def save(folder, ref_path):
    import torch.multiprocessing as mp

    store = os.path.join(tempfile.mkdtemp(), "store")
    mp.spawn(save_rank, args=(folder, store), nprocs=2)
    torch.save(full_tensors(), ref_path)
    files = sorted(p.name for p in pathlib.Path(folder).iterdir())
    print("dcp.save over 2 processes wrote " + ", ".join(files))


def lenet(nested, plain, pt):
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "python"))
    from ddp_peer import LeNet

    torch.manual_seed(11)
    sd = LeNet().state_dict()
    dcp.save({"model": sd}, checkpoint_id=nested, no_dist=True)
    dcp.save(sd, checkpoint_id=plain, no_dist=True)
    torch.save(dict(sd), pt)
    print(f"LeNet: {len(sd)} tensors saved three ways")


def lenet_adam(folder, pt):
    """A Python job's checkpoint: LeNet and Adam after 3 steps, dcp.save of get_state_dict()."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "python"))
    from ddp_peer import LeNet

    torch.manual_seed(11)
    model = LeNet()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for _ in range(3):
        opt.zero_grad()
        x, y = torch.randn(16, 1, 28, 28), torch.randint(0, 10, (16,))
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=folder, no_dist=True)
    torch.save(dict(model.state_dict()), pt)
    print(f"LeNet and Adam after 3 steps: {len(msd)} tensors, {len(osd['state'])} with state")


def foreign(folder):
    path = os.path.join(folder, ".metadata")
    with open(path, "rb") as f:
        md = pickle.load(f)
    md.planner_data = {"model.w": datetime.date(2020, 1, 1)}
    with open(path, "wb") as f:
        pickle.dump(md, f)


def mlp_and_adam():
    torch.manual_seed(2)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 4))
    return model, torch.optim.Adam(model.parameters(), lr=0.01)


def flat(model_sd, optim_sd):
    out = {"model." + k: v for k, v in model_sd.items()}
    for fqn, state in optim_sd["state"].items():
        out.update({f"optim.state.{fqn}.{kind}": t for kind, t in state.items()})
    return out


def optim_load(folder, ref_path):
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    ref = torch.load(ref_path, weights_only=False)
    model, opt = mlp_and_adam()
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=folder)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    msd, osd = get_state_dict(model, opt)
    got = flat(msd, osd)
    if sorted(got) != sorted(ref):
        fail(f"keys {sorted(got)} != {sorted(ref)}")
    for key, want in ref.items():
        same(key, got[key], want)
    step = float(got["optim.state.0.weight.step"])
    model(torch.randn(3, 5)).sum().backward()
    opt.step()  # every hyperparameter Python's Adam needs came with the checkpoint
    print(f"get_state_dict after dcp.load and set_state_dict: {len(ref)} tensors equal, "
          f"lr {opt.param_groups[0]['lr']}, step {step}")


def optim_save(folder, ref_path):
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, opt = mlp_and_adam()
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(8, 5)).pow(2).mean().backward()
        opt.step()
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=folder, no_dist=True)
    torch.save(flat(msd, osd), ref_path)
    print(f"3 Adam steps saved: {len(flat(msd, osd))} tensors")


def trainer(folder, pt):
    weights = torch.load(pt, weights_only=False)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "whole.pt")
        dcp_to_torch_save(folder, out)
        whole = torch.load(out, weights_only=False)
    if set(whole["model"]) != set(weights):
        fail(f"the folder's model has {sorted(whole['model'])}, model.pt {sorted(weights)}")
    state = {"model": {k: torch.empty_like(v) for k, v in weights.items()}}
    dcp.load(state, checkpoint_id=folder)
    for key, value in weights.items():
        same("dcp_to_torch_save model." + key, whole["model"][key], value)
        same("dcp.load model." + key, state["model"][key], value)
    optim = whole["optim"]
    kinds = sorted({k for s in optim["state"].values() for k in s})
    print(f"model: {len(weights)} tensors equal to model.pt; optimizer state of "
          f"{len(optim['state'])} parameters ({', '.join(kinds)}), lr "
          f"{optim['param_groups'][0]['lr']}; global_step {whole['scaletrain']['global_step']}")


def main():
    mode, args = sys.argv[1], sys.argv[2:]
    modes = {"check": check, "check-dtensor": check_dtensor, "save": save, "lenet": lenet, "foreign": foreign,
             "optim-load": optim_load, "optim-save": optim_save, "trainer": trainer,
             "lenet-adam": lenet_adam}
    modes[mode](*args)


if __name__ == "__main__":
    main()
