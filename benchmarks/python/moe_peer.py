"""PyTorch's own Python path for a mixture-of-experts layer on CPU ranks: the peer of
`scaletrain bench experts`.

The layer is scaletrain's MoE (include/scaletrain/expert_parallel.h) written in plain PyTorch:
a router (no bias) whose softmax, in float32, picks each token's top k experts, their
probabilities rescaled to sum to 1, Switch Transformer's load-balancing loss, and E experts, each
a GELU MLP (w1 [dim, hidden], w2 [hidden, dim]), E / world of them on each rank. Tokens go to
their experts' ranks the way TorchTitan's AllToAllTokenDispatcher sends them: sorted by expert,
the counts exchanged first with torch.distributed's all_to_all_single, then the rows with
all_to_all_single_autograd (torch.distributed._functional_collectives), regrouped by local
expert, each expert's rows through its MLP in a loop (TorchTitan's path without grouped_mm, which
has no CPU backward; the weights unbound once, as the C++ layer does), and back the same way.

The weights and tokens are functions of their indices (sin of a ramp), the same as the C++
side's, so both sides compute the same function: rank 0 writes the first step's loss.

    torchrun --nproc-per-node 2 benchmarks/python/moe_peer.py --csv out.csv

Each timed step is one forward and backward of the layer on this rank's tokens (loss: the mean
square of the output, plus the load-balancing loss times its coefficient). Rank 0 writes
`step,<seconds>` per timed step (the slowest rank's: a barrier ends each) and `loss,<first loss>`
to --csv.
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F


def ramp(shape, a, b, scale):
    n = 1
    for s in shape:
        n *= s
    return (torch.arange(n, dtype=torch.float64) * a + b).sin().mul(scale).float().reshape(shape)


def layer_weights(dim, hidden, experts):
    router = ramp((experts, dim), 0.37, 0.1, 0.5)
    w1 = ramp((experts, dim, hidden), 0.11, 0.3, dim ** -0.5)
    w2 = ramp((experts, hidden, dim), 0.07, 0.5, hidden ** -0.5)
    return router, w1, w2


def tokens_of(rank, count, dim):
    return ramp((count, dim), 0.013, 1.0 + rank, 1.0)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--csv", required=True)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--aux-loss-coef", type=float, default=0.01)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    a = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    group = dist.group.WORLD
    local = a.experts // world
    router, w1, w2 = layer_weights(a.dim, a.hidden, a.experts)
    router = router.requires_grad_()
    w1 = w1[rank * local:(rank + 1) * local].clone().requires_grad_()
    w2 = w2[rank * local:(rank + 1) * local].clone().requires_grad_()
    x = tokens_of(rank, a.tokens, a.dim).requires_grad_()

    def step():
        for t in (router, w1, w2, x):
            t.grad = None
        probs = F.softmax(F.linear(x, router), dim=-1, dtype=torch.float32)
        top, ids = probs.topk(a.top_k, dim=-1)
        if a.top_k > 1:
            top = top / top.sum(-1, keepdim=True)
        flat = ids.reshape(-1)
        counts = torch.bincount(flat, minlength=a.experts)
        aux = (counts.float() / flat.numel() * probs.mean(0)).sum() * a.experts
        order = torch.argsort(flat, stable=True)
        token_of = order // a.top_k
        rows = x.index_select(0, token_of)
        # The dispatch: counts first, then the rows.
        received_counts = torch.empty_like(counts)
        dist.all_to_all_single(received_counts, counts, group=group)
        sent = counts.view(world, local).sum(1).tolist()
        received = received_counts.view(world, local).sum(1).tolist()
        arrived = funcol.all_to_all_single_autograd(rows, received, sent, group)
        # By (source rank, local expert) to (local expert, source rank).
        grid = received_counts.view(world, local)
        starts = torch.cumsum(received_counts, 0) - received_counts
        perm = torch.cat([torch.arange(int(starts[j * local + e]),
                                       int(starts[j * local + e]) + int(grid[j, e]))
                          for e in range(local) for j in range(world)])
        grouped = arrived.index_select(0, perm)
        per_expert = grid.sum(0).tolist()
        # Each weight unbound once, as the C++ layer does (one stack in backward, where w1[e]
        # would fill a zero tensor of the whole weight per expert): the same layer both sides.
        u1, u2 = w1.unbind(0), w2.unbind(0)
        outs = [F.gelu(part @ u1[e]) @ u2[e]
                for e, part in enumerate(torch.split(grouped, per_expert))]
        y = torch.cat(outs)
        undo = torch.empty_like(perm)
        undo[perm] = torch.arange(perm.numel())
        back = funcol.all_to_all_single_autograd(y.index_select(0, undo), sent, received, group)
        weights = top.reshape(-1).index_select(0, order).unsqueeze(1)
        out = torch.zeros_like(x).index_add(0, token_of, back * weights)
        loss = out.pow(2).mean()
        (loss + a.aux_loss_coef * aux).backward()
        return loss.item()

    first = step()
    for _ in range(a.warmup - 1):
        step()
    times = []
    for _ in range(a.steps):
        dist.barrier()
        t0 = time.perf_counter()
        step()
        dist.barrier()
        times.append(time.perf_counter() - t0)
    losses = [torch.zeros(1, dtype=torch.float64) for _ in range(world)]
    dist.all_gather(losses, torch.tensor([first], dtype=torch.float64))
    if rank == 0:
        with open(a.csv, "w") as f:
            for t in times:
                f.write(f"step,{t}\n")
            f.write(f"loss,{sum(float(v) for v in losses) / world}\n")
    dist.barrier()
    # The functional collectives' background thread now and then aborts the interpreter's
    # teardown ("terminate called without an active exception") after everything is written:
    # leave without it.
    os._exit(0)


if __name__ == "__main__":
    main()
