"""Python's side of tests/python_model_test.cpp: TorchScript modules for scaletrain to train, and
the same training in eager PyTorch to compare with.

  make DIR              DIR/cnn.pt (a scripted nn.Sequential CNN), DIR/lm.pt (a scripted
                        decoder of its own class), DIR/bad_arity.pt, DIR/frozen.pt, and
                        DIR/data.pt (images, classes, tokens, next tokens)
  eager DIR KIND RUN    trains KIND (cnn or lm) eagerly from its module's initial weights with
                        SGD (lr 0.05, momentum 0.9: the trainer's default) on the batches of
                        RUN/order.json (one list of sample indices per step), loads RUN/model.pt
                        into the scripted module by name, and prints JSON: the step losses, the
                        largest weight and the largest difference from the eager weights
"""
import json
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, CONTEXT, WIDTH = 32, 8, 16


def cnn():
    return nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                         nn.Linear(4 * 13 * 13, 10))


class Decoder(nn.Module):
    """A one-block causal transformer over token ids: logits [B, T, VOCAB]."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.pos = nn.Parameter(torch.randn(CONTEXT, WIDTH) * 0.02)
        self.norm = nn.LayerNorm(WIDTH)
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, x):
        h = self.embed(x) + self.pos[: x.size(1)]
        b, t, c = h.shape
        q, k, v = self.qkv(self.norm(h)).view(b, t, 3, 2, c // 2).permute(2, 0, 3, 1, 4).unbind(0)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = h + self.proj(a.transpose(1, 2).reshape(b, t, c))
        return self.head(h + self.mlp(h))


class TwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x, y):
        return self.fc(x) + y


def make(out):
    torch.manual_seed(0)
    torch.jit.save(torch.jit.script(cnn()), f"{out}/cnn.pt")
    torch.jit.save(torch.jit.script(Decoder()), f"{out}/lm.pt")
    torch.jit.save(torch.jit.script(TwoInputs()), f"{out}/bad_arity.pt")
    frozen = nn.Linear(4, 2).requires_grad_(False)
    torch.jit.save(torch.jit.script(frozen), f"{out}/frozen.pt")
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (64, CONTEXT + 1), generator=g)
    torch.save({"images": torch.randn(64, 1, 28, 28, generator=g),
                "classes": torch.randint(0, 10, (64,), generator=g),
                "tokens": tokens[:, :-1].contiguous(), "next": tokens[:, 1:].contiguous()},
               f"{out}/data.pt")


def eager(d, kind, run):
    model = cnn() if kind == "cnn" else Decoder()
    scripted = torch.jit.load(f"{d}/{kind}.pt")
    model.load_state_dict(scripted.state_dict())
    data = torch.load(f"{d}/data.pt")
    x, y = (data["images"], data["classes"]) if kind == "cnn" else (data["tokens"], data["next"])
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for idx in json.load(open(f"{run}/order.json")):
        idx = torch.tensor(idx)
        out = model(x[idx])
        loss = F.cross_entropy(out.reshape(-1, out.size(-1)), y[idx].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    scripted.load_state_dict(torch.load(f"{run}/model.pt"))  # by the module's own names
    mine = model.state_dict()
    diff = max((v - mine[k]).abs().max().item() for k, v in scripted.state_dict().items())
    big = max(v.abs().max().item() for v in mine.values())
    print(json.dumps({"losses": losses, "max_weight": big, "max_diff": diff}))


if __name__ == "__main__":
    torch.set_num_threads(1)
    if sys.argv[1] == "make":
        make(sys.argv[2])
    else:
        eager(sys.argv[2], sys.argv[3], sys.argv[4])
