"""transformers' side of tests/llama_test.cpp: random tiny Llama and GPT-2 models and what they
compute.

  make DIR     DIR/hf (a Llama by save_pretrained: GQA, 2 layers, vocabulary 256), DIR/hf_sharded
               (the same in shards of at most 100 kB with their index), DIR/hf_tied (a tied head),
               DIR/gpt2 (a GPT2LMHeadModel: 2 layers, 64 wide, vocabulary 256, tied head);
               DIR/ref.pt and DIR/gpt2_ref.pt: token ids, next tokens, transformers' logits, loss
               and every parameter's gradient (grad.<name>, under transformers' names and
               shapes), and (ref.pt) the Llama's rotary cos/sin of 16 positions
  check OUT    loads OUT/hf with from_pretrained and OUT/model.pt with torch.load; prints JSON:
               the tensors that differ (Conv1D weights compared transposed), the missing ones,
               and the loss on other tokens
"""
import json
import sys

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding


def config(tied=False):
    return LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                       rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=tied,
                       attn_implementation="sdpa")


def reference(model, ids, targets):
    logits = model(ids).logits
    loss = F.cross_entropy(logits.reshape(-1, 256), targets.reshape(-1))
    loss.backward()
    ref = {"ids": ids, "targets": targets, "logits": logits.detach(), "loss": loss.detach()}
    for name, p in model.named_parameters():
        ref["grad." + name] = p.grad
    return ref


def make(out):
    torch.manual_seed(4)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=64, n_embd=64, n_layer=2,
                                      n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                      attn_implementation="sdpa"))
    gpt2.save_pretrained(f"{out}/gpt2", safe_serialization=True)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config())
    model.save_pretrained(f"{out}/hf", safe_serialization=True)
    model.save_pretrained(f"{out}/hf_sharded", safe_serialization=True, max_shard_size="100KB")
    torch.manual_seed(1)
    LlamaForCausalLM(config(tied=True)).save_pretrained(f"{out}/hf_tied", safe_serialization=True)
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, 256, (4, 17), generator=g)
    ids, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    torch.save(reference(gpt2, ids, targets), f"{out}/gpt2_ref.pt")
    ref = reference(model, ids, targets)
    rotary = LlamaRotaryEmbedding(config())
    cos, sin = rotary(torch.zeros(1, dtype=torch.float32), torch.arange(16)[None, :])
    ref["cos"], ref["sin"] = cos[0], sin[0]
    torch.save(ref, f"{out}/ref.pt")


def check(out):
    model = AutoModelForCausalLM.from_pretrained(f"{out}/hf", dtype=torch.float32)
    trained = torch.load(f"{out}/model.pt")
    mine = model.state_dict()
    conv1d = {n + ".weight" for n, m in model.named_modules() if type(m).__name__ == "Conv1D"}
    differ = [k for k, v in trained.items()
              if k in mine and not torch.equal(mine[k].t() if k in conv1d else mine[k], v)]
    missing = [k for k in trained if k not in mine]
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 256, (2, 17), generator=g)
    loss = F.cross_entropy(model(tokens[:, :-1]).logits.reshape(-1, 256), tokens[:, 1:].reshape(-1))
    print(json.dumps({"differ": differ, "missing": missing, "loss": loss.item()}))


if __name__ == "__main__":
    torch.set_num_threads(1)
    {"make": make, "check": check}[sys.argv[1]](sys.argv[2])
