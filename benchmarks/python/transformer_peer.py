"""PyTorch's own Python path for a GPT on CPU ranks: the peer of `scaletrain bench transformer`.

The model is scaletrain's zoo GPT written in plain PyTorch with nanoGPT's layout and names
(transformer.wte, transformer.wpe, transformer.h.<i>.{ln_1, attn.c_attn, attn.c_proj, ln_2,
mlp.c_fc, mlp.c_proj}, transformer.ln_f, an untied lm_head): token and position embeddings,
pre-LayerNorm blocks of causal scaled_dot_product_attention and a GELU MLP four times as wide.
Its parameter count is checked against the C++ model's (--expect-params).

Modes, one process per rank started with torchrun's environment, gloo:
  ddp      torch.nn.parallel.DistributedDataParallel, each rank its share of the global batch;
  tp       torch.distributed.tensor.parallel.parallelize_module over all ranks with Megatron's
           plan (the same as scaletrain's GPT::parallelize): c_attn and c_fc ColwiseParallel,
           the two c_proj RowwiseParallel, wte RowwiseParallel (vocabulary split), lm_head
           ColwiseParallel with its logits left split and the loss under loss_parallel();
  tp-sp    the same with sequence parallelism: the LayerNorms SequenceParallel, wte's output
           and the row-parallel outputs reduce-scattered along the sequence, the
           column-parallel inputs gathered along it;
  fsdp     FSDP2 (fully_shard on every block, then on the model) over all ranks;
  fsdp-tp  2D: the tp plan over pairs of consecutive ranks, FSDP2 over the pairs;
  pp-tp    3D's pipeline and tensor dimensions on 4 ranks, the mesh (pp 2, tp 2): the tp plan
           over pairs of consecutive ranks, the model cut into two stages (embeddings and the
           first half of the blocks; the second half, ln_f and lm_head) run by
           torch.distributed.pipelining's PipelineStage under Schedule1F1B over --chunks
           micro-batches, the loss under loss_parallel().

    torchrun --nproc-per-node 2 benchmarks/python/transformer_peer.py --mode tp --csv out.csv

--arch llama trains the zoo's Llama instead (zoo/llama.h, Hugging Face's names: model.embed_tokens,
model.layers.<i>.{input_layernorm, self_attn.{q,k,v,o}_proj, post_attention_layernorm,
mlp.{gate,up,down}_proj}, model.norm, lm_head): RMSNorm, rotary embeddings, grouped-query
attention, SwiGLU; its plan splits q/k/v/gate/up by columns and o/down by rows, and sequence
parallelism covers the RMSNorms.

Rank 0 writes `step,<seconds>` per timed step, `rss,<rank>,<bytes>` per rank (peak resident
memory), `params,<count>` and `loss,<last loss>` to --csv.
"""
import argparse
import os
import resource
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


class Attention(nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.head_dim = width // heads
        self.c_attn = nn.Linear(width, 3 * width)
        self.c_proj = nn.Linear(width, width)

    def forward(self, x):
        qkv = self.c_attn(x)  # [B, T, 3C], or this rank's heads of q, k and v: [B, T, 3C/tp]
        b, t = qkv.shape[0], qkv.shape[1]
        q, k, v = (p.view(b, t, -1, self.head_dim).transpose(1, 2) for p in qkv.chunk(3, -1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(b, t, -1))


class Mlp(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.c_fc = nn.Linear(width, 4 * width)
        self.c_proj = nn.Linear(4 * width, width)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.ln_1 = nn.LayerNorm(width)
        self.attn = Attention(width, heads)
        self.ln_2 = nn.LayerNorm(width)
        self.mlp = Mlp(width)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Stage(nn.Module):
    """Blocks [begin, end) of a GPT, with its embeddings on the first stage and its head on the
    last: pipelining's stage module (the blocks are the GPT's own, already split by the tp
    plan)."""

    def __init__(self, gpt, begin, end):
        super().__init__()
        layers = len(gpt.transformer.h)
        self.wte = gpt.transformer.wte if begin == 0 else None
        self.wpe = gpt.transformer.wpe if begin == 0 else None
        self.h = nn.ModuleList(gpt.transformer.h[i] for i in range(begin, end))
        self.ln_f = gpt.transformer.ln_f if end == layers else None
        self.lm_head = gpt.lm_head if end == layers else None

    def forward(self, x):
        if self.wte is not None:
            x = self.wte(x) + self.wpe(torch.arange(x.shape[1]))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x)) if self.lm_head is not None else x


class GPT(nn.Module):
    def __init__(self, vocab, context, layers, heads, width):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab, width),
            wpe=nn.Embedding(context, width),
            h=nn.ModuleList(Block(width, heads) for _ in range(layers)),
            ln_f=nn.LayerNorm(width)))
        self.lm_head = nn.Linear(width, vocab, bias=False)
        self.seq_shard = None  # (rank, degree) under sequence parallelism
        # GPT-2's initialisation, as the C++ model's: N(0, 0.02), zero biases, the projections
        # into the residual N(0, 0.02 / sqrt(2 * layers)), LayerNorms ones and zeros.
        for name, p in self.named_parameters():
            if "ln_" in name:
                continue
            if name.endswith("bias"):
                nn.init.zeros_(p)
            else:
                std = 0.02 / (2 * layers) ** 0.5 if name.endswith("c_proj.weight") else 0.02
                nn.init.normal_(p, 0.0, std)

    def forward(self, ids):
        x = self.transformer.wte(ids)  # [B, T, C], or this rank's slice of the positions
        first = self.seq_shard[0] * x.shape[1] if self.seq_shard else 0
        x = x + self.transformer.wpe(torch.arange(first, first + x.shape[1]))
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


class RMSNorm(nn.Module):
    def __init__(self, width, eps=1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x):
        h = x.float()
        return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), -1)


class LlamaAttention(nn.Module):
    def __init__(self, width, heads, kv_heads):
        super().__init__()
        self.head_dim = width // heads
        self.q_proj = nn.Linear(width, heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(width, kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(width, kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(heads * self.head_dim, width, bias=False)

    def forward(self, x):  # x: the whole sequence (a colwise layer gathers a slice)
        q = self.q_proj(x)
        b, t, d = q.shape[0], q.shape[1], self.head_dim
        q = q.view(b, t, -1, d).transpose(1, 2)
        k = self.k_proj(x).view(b, t, -1, d).transpose(1, 2)
        v = self.v_proj(x).view(b, t, -1, d).transpose(1, 2)
        inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2).float() / d))
        angles = torch.outer(torch.arange(t).float(), inv)
        both = torch.cat((angles, angles), -1)
        cos, sin = both.cos(), both.sin()
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class LlamaMlp(nn.Module):
    def __init__(self, width, inner):
        super().__init__()
        self.gate_proj = nn.Linear(width, inner, bias=False)
        self.up_proj = nn.Linear(width, inner, bias=False)
        self.down_proj = nn.Linear(inner, width, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaLayer(nn.Module):
    def __init__(self, width, heads, kv_heads, inner):
        super().__init__()
        self.input_layernorm = RMSNorm(width)
        self.self_attn = LlamaAttention(width, heads, kv_heads)
        self.post_attention_layernorm = RMSNorm(width)
        self.mlp = LlamaMlp(width, inner)

    def forward(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama(nn.Module):
    def __init__(self, vocab, layers, heads, kv_heads, width, inner):
        super().__init__()
        self.model = nn.ModuleDict(dict(
            embed_tokens=nn.Embedding(vocab, width),
            layers=nn.ModuleList(LlamaLayer(width, heads, kv_heads, inner) for _ in range(layers)),
            norm=RMSNorm(width)))
        self.lm_head = nn.Linear(width, vocab, bias=False)
        for name, p in self.named_parameters():
            if "norm" not in name:
                nn.init.normal_(p, 0.0, 0.02)

    def blocks(self):
        return self.model.layers

    def forward(self, ids):
        x = self.model.embed_tokens(ids)
        for layer in self.model.layers:
            x = layer(x)
        return self.lm_head(self.model.norm(x))


class LlamaStage(nn.Module):
    """Layers [begin, end) of a Llama, its embedding on the first stage, its head on the last."""

    def __init__(self, llama, begin, end):
        super().__init__()
        layers = len(llama.model.layers)
        self.embed_tokens = llama.model.embed_tokens if begin == 0 else None
        self.layers = nn.ModuleList(llama.model.layers[i] for i in range(begin, end))
        self.norm = llama.model.norm if end == layers else None
        self.lm_head = llama.lm_head if end == layers else None

    def forward(self, x):
        if self.embed_tokens is not None:
            x = self.embed_tokens(x)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x)) if self.lm_head is not None else x


def parallelize_llama(model, tp, sp, mesh=None):
    """The Llama's plan through DTensor, as TorchTitan lays it out."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)
    if mesh is None:
        mesh = init_device_mesh("cpu", (tp,))
    seq = Shard(1) if sp else Replicate()
    plan = {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        "lm_head": ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1),
                                   use_local_output=False),
    }
    if sp:
        plan["model.norm"] = SequenceParallel()
    for i in range(len(model.model.layers)):
        b = f"model.layers.{i}."
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj",
                     "mlp.up_proj"):
            plan[b + name] = ColwiseParallel(input_layouts=seq)
        plan[b + "self_attn.o_proj"] = RowwiseParallel(output_layouts=seq)
        plan[b + "mlp.down_proj"] = RowwiseParallel(output_layouts=seq)
        if sp:
            plan[b + "input_layernorm"] = SequenceParallel()
            plan[b + "post_attention_layernorm"] = SequenceParallel()
    parallelize_module(model, mesh, plan)


def interleave_qkv(model, tp):
    """Orders each c_attn's rows as [q_0 k_0 v_0 q_1 k_1 v_1 ...] (r: rank r's heads), so that
    ColwiseParallel's contiguous row shards give every rank its own heads of q, k and v, as
    scaletrain's colwise(3) cuts them. One permutation of the parameters before the split."""
    with torch.no_grad():
        for block in model.transformer.h:
            for p in (block.attn.c_attn.weight, block.attn.c_attn.bias):
                parts = [c.chunk(tp, 0) for c in p.chunk(3, 0)]
                p.copy_(torch.cat([parts[i][r] for r in range(tp) for i in range(3)], 0))


def parallelize(model, tp, sp, mesh=None):
    """Megatron's plan through DTensor, as PyTorch's tensor-parallel tutorial lays it out, over
    `mesh` (default: a mesh of `tp` ranks, the world)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)
    if mesh is None:
        mesh = init_device_mesh("cpu", (tp,))
    seq = Shard(1) if sp else Replicate()
    plan = {
        "transformer.wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        "lm_head": ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1),
                                   use_local_output=False),
    }
    if sp:
        plan["transformer.ln_f"] = SequenceParallel()
    for i in range(len(model.transformer.h)):
        b = f"transformer.h.{i}."
        plan[b + "attn.c_attn"] = ColwiseParallel(input_layouts=seq)
        plan[b + "attn.c_proj"] = RowwiseParallel(output_layouts=seq)
        plan[b + "mlp.c_fc"] = ColwiseParallel(input_layouts=seq)
        plan[b + "mlp.c_proj"] = RowwiseParallel(output_layouts=seq)
        if sp:
            plan[b + "ln_1"] = SequenceParallel()
            plan[b + "ln_2"] = SequenceParallel()
    interleave_qkv(model, tp)
    parallelize_module(model, mesh, plan)
    if sp:
        model.seq_shard = (mesh.get_local_rank(), tp)


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["ddp", "tp", "tp-sp", "fsdp", "fsdp-tp", "pp-tp"], default="ddp")
    p.add_argument("--arch", choices=["gpt", "llama"], default="gpt")
    p.add_argument("--kv-heads", type=int, default=0, help="llama: key/value heads")
    p.add_argument("--intermediate", type=int, default=0, help="llama: the MLP's width")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=4, help="global batch, sequences")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--chunks", type=int, default=4, help="pp-tp: micro-batches per step")
    p.add_argument("--expect-params", type=int, default=0)
    p.add_argument("--csv", required=True)
    return p.parse_args()


def main():
    args = parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    if args.arch == "llama":
        model = Llama(args.vocab, args.layers, args.heads, args.kv_heads, args.width,
                      args.intermediate)
    else:
        model = GPT(args.vocab, args.context, args.layers, args.heads, args.width)
    params = sum(p.numel() for p in model.parameters())
    if args.expect_params and params != args.expect_params:
        raise SystemExit(f"the Python {args.arch} has {params} parameters, the C++ one "
                         f"{args.expect_params}: the architectures differ")
    mode = args.mode
    # Data-parallel degree and this rank's replica: the batch splits over the replicas; the ranks
    # of a tensor-parallel group (consecutive ranks, dp outer) see the same rows.
    dp = {"ddp": world, "fsdp": world, "fsdp-tp": world // 2}.get(mode, 1)
    replica = rank // (world // dp)
    if args.batch_size % dp:
        raise SystemExit(f"a global batch of {args.batch_size} sequences does not split over "
                         f"{dp} replicas; use a multiple of them")
    if mode == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
    elif mode in ("fsdp", "fsdp-tp"):
        # FSDP2: each block a unit, then the root (embeddings, final LayerNorm, head).
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        if mode == "fsdp":
            dp_mesh = init_device_mesh("cpu", (world,))
        else:
            mesh = init_device_mesh("cpu", (dp, 2), mesh_dim_names=("dp", "tp"))
            split(args, model, 2, False, mesh["tp"])
            dp_mesh = mesh["dp"]
        for block in blocks(model):
            fully_shard(block, mesh=dp_mesh)
        fully_shard(model, mesh=dp_mesh)
    elif mode == "pp-tp":
        return pipelined(args, model, rank, world, params)
    else:
        split(args, model, world, mode == "tp-sp")
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    gen = torch.Generator().manual_seed(1 + replica)
    data = torch.randint(args.vocab, (args.batch_size // dp, args.context + 1), generator=gen)
    x, y = data[:, :-1].contiguous(), data[:, 1:].contiguous()
    times, loss = timed(args, make_step(model, opt, x, y, args.mode))
    report(args, rank, world, times, params, loss)
    dist.barrier()
    dist.destroy_process_group()


def blocks(model):
    return model.model.layers if isinstance(model, Llama) else model.transformer.h


def split(args, model, tp, sp, mesh=None):
    (parallelize_llama if args.arch == "llama" else parallelize)(model, tp, sp, mesh)


def timed(args, step):
    for _ in range(args.warmup):
        step()
    dist.barrier()
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        loss = step()
        times.append(time.perf_counter() - t0)
    return times, loss


def pipelined(args, model, rank, world, params):
    """pp-tp: the mesh (pp 2, tp 2); a stage's two tp ranks run the same pipeline tasks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B
    from torch.distributed.tensor.parallel import loss_parallel
    if world != 4:
        raise SystemExit(f"pp-tp runs on 4 ranks (pp 2 x tp 2), not {world}")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    split(args, model, 2, False, mesh["tp"])
    layers = len(blocks(model))
    stage_index, half = mesh.get_local_rank("pp"), layers // 2
    cut = LlamaStage if args.arch == "llama" else Stage
    module = cut(model, 0, half) if stage_index == 0 else cut(model, half, layers)
    stage = PipelineStage(module, stage_index, 2, torch.device("cpu"),
                          group=mesh["pp"].get_group())

    def loss_fn(logits, target):  # logits: a DTensor, its vocabulary split over tp
        return F.cross_entropy(logits.flatten(0, 1), target.flatten())

    schedule = Schedule1F1B(stage, args.chunks, loss_fn=loss_fn)
    opt = torch.optim.AdamW(module.parameters(), lr=3e-4, weight_decay=0.1)
    gen = torch.Generator().manual_seed(1)
    data = torch.randint(args.vocab, (args.batch_size, args.context + 1), generator=gen)
    x, y = data[:, :-1].contiguous(), data[:, 1:].contiguous()
    last = stage_index == 1

    def step():
        opt.zero_grad()
        losses = []
        with loss_parallel():  # the parallel loss's backward runs inside the schedule too
            if stage_index == 0:
                schedule.step(x)
            else:
                schedule.step(target=y, losses=losses)
        opt.step()
        # The batch's loss (the mean of the micro-batches'), from the last stage's tp rank 0.
        mean = torch.zeros(1, dtype=torch.float64)
        if last:
            mean[0] = sum(float(l.detach().full_tensor()) for l in losses) / len(losses)
        dist.broadcast(mean, src=2)
        return float(mean[0])

    times, loss = timed(args, step)
    report(args, rank, world, times, params, loss)
    dist.barrier()
    dist.destroy_process_group()


def make_step(model, opt, x, y, mode):
    if mode in ("ddp", "fsdp"):
        def step():
            opt.zero_grad()
            logits = model(x)
            loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
            loss.backward()
            opt.step()
            return float(loss.detach())
        return step
    from torch.distributed.tensor.parallel import loss_parallel
    wpe = model.transformer.wpe.weight if isinstance(model, GPT) else None

    def step():
        opt.zero_grad()
        logits = model(x)  # a DTensor, its vocabulary split over the ranks
        with loss_parallel():
            loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
            loss.backward()
        if mode == "tp-sp" and wpe is not None:  # each rank used its own positions: summed
            dist.all_reduce(wpe.grad)
        opt.step()
        return float(loss.detach().full_tensor())
    return step


def report(args, rank, world, times, params, loss):
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    all_rss = [None] * world
    dist.all_gather_object(all_rss, rss)
    if rank == 0:
        with open(args.csv, "w") as f:
            for t in times:
                f.write(f"step,{t}\n")
            for r, v in enumerate(all_rss):
                f.write(f"rss,{r},{v}\n")
            f.write(f"params,{params}\n")
            f.write(f"loss,{loss}\n")


if __name__ == "__main__":
    main()
    # torch 2.11 on CPU sometimes aborts in its exit-time destructors after DTensor's collectives
    # ("terminate called without an active exception"), after every result is written and the
    # group destroyed: leave without them.
    os._exit(0)
