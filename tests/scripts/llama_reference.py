"""transformers' side of tests/llama_test.cpp: a random tiny Llama and what it computes.

  make DIR     DIR/hf (save_pretrained: GQA, 2 layers, vocabulary 256), DIR/hf_sharded (the
               same in shards of at most 100 kB with their index), DIR/hf_tied (a tied head),
               DIR/ref.pt: token ids, next tokens, transformers' logits, loss and every
               parameter's gradient (grad.<name>), and the rotary cos/sin of 16 positions
  check OUT    loads OUT/hf with from_pretrained and OUT/model.pt with torch.load; prints JSON:
               the tensors that differ, and the loss of each on the same tokens
"""
import json
import sys

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding


def config(tied=False):
    return LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                       rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=tied,
                       attn_implementation="sdpa")


def make(out):
    torch.manual_seed(0)
    model = LlamaForCausalLM(config())
    model.save_pretrained(f"{out}/hf", safe_serialization=True)
    model.save_pretrained(f"{out}/hf_sharded", safe_serialization=True, max_shard_size="100KB")
    torch.manual_seed(1)
    LlamaForCausalLM(config(tied=True)).save_pretrained(f"{out}/hf_tied", safe_serialization=True)
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, 256, (4, 17), generator=g)
    ids, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    logits = model(ids).logits
    loss = F.cross_entropy(logits.reshape(-1, 256), targets.reshape(-1))
    loss.backward()
    ref = {"ids": ids, "targets": targets, "logits": logits.detach(), "loss": loss.detach()}
    for name, p in model.named_parameters():
        ref["grad." + name] = p.grad
    rotary = LlamaRotaryEmbedding(config())
    cos, sin = rotary(torch.zeros(1, dtype=torch.float32), torch.arange(16)[None, :])
    ref["cos"], ref["sin"] = cos[0], sin[0]
    torch.save(ref, f"{out}/ref.pt")


def check(out):
    model = LlamaForCausalLM.from_pretrained(f"{out}/hf", torch_dtype=torch.float32)
    trained = torch.load(f"{out}/model.pt")
    mine = model.state_dict()
    differ = [k for k, v in trained.items() if not torch.equal(mine[k], v)]
    missing = [k for k in trained if k not in mine]
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 256, (2, 17), generator=g)
    loss = F.cross_entropy(model(tokens[:, :-1]).logits.reshape(-1, 256), tokens[:, 1:].reshape(-1))
    print(json.dumps({"differ": differ, "missing": missing, "loss": loss.item()}))


if __name__ == "__main__":
    torch.set_num_threads(1)
    {"make": make, "check": check}[sys.argv[1]](sys.argv[2])
