#include "zoo_models.h"

#include <torch/nn/functional/pooling.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/dropout.h>
#include <torch/nn/modules/linear.h>

#include "gpt.h"
#include "hf_folder.h"
#include "kernels/ops.h"
#include "llama.h"
#include "scaletrain/blocks.h"
#include "scaletrain/checkpoint.h"
#include "scaletrain/error.h"
#include "scaletrain/python_model.h"

namespace scaletrain {
namespace {

namespace F = torch::nn::functional;

struct ToyModelImpl : torch::nn::Module {
  ToyModelImpl() {
    net1 = register_module("net1", torch::nn::Linear(10, 10));
    net2 = register_module("net2", torch::nn::Linear(10, 5));
  }
  at::Tensor forward(const at::Tensor& x) { return net2(torch::relu(net1(x))); }
  torch::nn::Linear net1{nullptr}, net2{nullptr};
};

struct MLPImpl : torch::nn::Module {
  explicit MLPImpl(const ModelOptions& o) {
    fc1 = register_module("fc1", torch::nn::Linear(o.in_features, o.hidden));
    fc2 = register_module("fc2", torch::nn::Linear(o.hidden, o.num_classes));
    drop = register_module("drop", torch::nn::Dropout(o.dropout));
  }
  at::Tensor hidden(const at::Tensor& x) { return drop(torch::relu(fc1(x.flatten(1)))); }
  at::Tensor forward(const at::Tensor& x) { return fc2(hidden(x)); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  torch::nn::Dropout drop{nullptr};
};

// Note [Unread border]
// ~~~~~~~~~~~~~~~~~~~~
// LeNet's 2x2 pools round down. On a 28x28 image conv2 gives 9x9 and the pool reads 8x8 of it:
// conv2's last row and column are computed and then dropped, and so, step by step back, are
// pool1's 13th row, conv1's last two and the image's last two. Nothing the loss depends on is
// there, and their gradient is zero. LeNet therefore crops its input to the rows and columns its
// output depends on (26x26 of 28x28) and every layer computes only what is read: conv2 does 64
// of its 81 output pixels, conv1 576 of 676, a fifth less work in the heaviest layer. The
// function and its gradients are the uncropped model's; only the floating-point order inside a
// convolution may differ (Models.LeNetEqualsItsUncroppedLayers checks to 1e-5).
int64_t lenet_extent_read(int64_t n) {
  const int64_t pooled = ((n - 3 + 1) / 2 - 5 + 1) / 2;  // conv1 3x3, pool, conv2 5x5, pool
  return (2 * pooled + 5 - 1) * 2 + 3 - 1;
}

at::Tensor lenet_crop(const at::Tensor& x) {
  const int64_t h = lenet_extent_read(x.size(2)), w = lenet_extent_read(x.size(3));
  if (h >= x.size(2) && w >= x.size(3)) return x;
  return x.slice(2, 0, h).slice(3, 0, w);
}

// The plain layers, as the Python model writes them: no crop, LibTorch's relu and pool.
at::Tensor relu_pool(const at::Tensor& x) {
  return F::avg_pool2d(torch::relu(x), F::AvgPool2dFuncOptions(2));
}

struct LeNetImpl : torch::nn::Module {
  explicit LeNetImpl(const ModelOptions& o) : optimized(o.model_optimizations) {
    conv1 = register_module("conv1", torch::nn::Conv2d(o.in_channels, 20, 3));
    conv2 = register_module("conv2", torch::nn::Conv2d(20, 50, 5));
    fc1 = register_module("fc1", torch::nn::Linear(800, 128));
    fc2 = register_module("fc2", torch::nn::Linear(128, o.num_classes));
  }
  at::Tensor stem(const at::Tensor& x) {
    if (!optimized) return relu_pool(conv1(x));
    return relu_avg_pool2x2(conv2d(conv1, lenet_crop(x)));  // Note [Unread border]
  }
  at::Tensor second(const at::Tensor& x) {
    return optimized ? relu_avg_pool2x2(conv2(x)) : relu_pool(conv2(x));
  }
  at::Tensor forward(const at::Tensor& x) {
    return fc2(torch::relu(fc1(second(stem(x)).flatten(1))));
  }
  bool optimized;
  torch::nn::Conv2d conv1{nullptr}, conv2{nullptr};
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};

// A residual block's projection when its shape changes: 1x1 conv + batch norm, torchvision's
// "downsample.0" and "downsample.1".
torch::nn::Sequential shortcut(int64_t in, int64_t out, int64_t stride) {
  namespace nn = torch::nn;
  return nn::Sequential(nn::Conv2d(nn::Conv2dOptions(in, out, 1).stride(stride).bias(false)),
                        nn::BatchNorm2d(out));
}

// torchvision's BasicBlock: conv3x3-bn-relu-conv3x3-bn, plus a 1x1 conv + bn shortcut
// ("downsample.0", "downsample.1") when the shape changes.
struct BasicBlockImpl : torch::nn::Module {
  BasicBlockImpl(int64_t in, int64_t out, int64_t stride) {
    namespace nn = torch::nn;
    conv1 = register_module(
        "conv1", nn::Conv2d(nn::Conv2dOptions(in, out, 3).stride(stride).padding(1).bias(false)));
    bn1 = register_module("bn1", nn::BatchNorm2d(out));
    conv2 =
        register_module("conv2", nn::Conv2d(nn::Conv2dOptions(out, out, 3).padding(1).bias(false)));
    bn2 = register_module("bn2", nn::BatchNorm2d(out));
    if (stride != 1 || in != out)
      downsample = register_module("downsample", shortcut(in, out, stride));
  }
  at::Tensor forward(const at::Tensor& x) {
    auto h = torch::relu(bn1(conv1(x)));
    h = bn2(conv2(h));
    return torch::relu(h + (downsample ? downsample->forward(x) : x));
  }
  torch::nn::Conv2d conv1{nullptr}, conv2{nullptr};
  torch::nn::BatchNorm2d bn1{nullptr}, bn2{nullptr};
  torch::nn::Sequential downsample{nullptr};
};
TORCH_MODULE(BasicBlock);

// The small-image ResNet-18 of seed 003: a 3x3 stride-1 stem and no max-pool, so 28x28
// inputs keep their resolution in layer1; torchvision's names otherwise.
struct ResNet18SmallImpl : torch::nn::Module {
  explicit ResNet18SmallImpl(const ModelOptions& o) : optimized(o.model_optimizations) {
    namespace nn = torch::nn;
    conv1 = register_module(
        "conv1", nn::Conv2d(nn::Conv2dOptions(o.in_channels, 64, 3).padding(1).bias(false)));
    bn1 = register_module("bn1", nn::BatchNorm2d(64));
    int64_t in = 64;
    const int64_t widths[] = {64, 128, 256, 512};
    for (int i = 0; i < 4; ++i) {
      nn::Sequential layer;
      layer->push_back(BasicBlock(in, widths[i], i == 0 ? 1 : 2));
      layer->push_back(BasicBlock(widths[i], widths[i], 1));
      layers.push_back(register_module("layer" + std::to_string(i + 1), layer));
      in = widths[i];
    }
    fc = register_module("fc", nn::Linear(512, o.num_classes));
  }
  at::Tensor stem(const at::Tensor& x) {
    return torch::relu(bn1(optimized ? conv2d(conv1, x) : conv1(x)));
  }
  at::Tensor forward(const at::Tensor& x) {
    auto h = stem(x);
    for (auto& l : layers) h = l->forward(h);
    return fc(h.mean({2, 3}));
  }
  bool optimized;
  torch::nn::Conv2d conv1{nullptr};
  torch::nn::BatchNorm2d bn1{nullptr};
  std::vector<torch::nn::Sequential> layers;
  torch::nn::Linear fc{nullptr};
};

// torchvision's Bottleneck (v1.5: the stride sits on the 3x3 conv): 1x1 reduce, 3x3, 1x1
// expand by 4, each with batch norm, plus a 1x1 conv + bn shortcut when the shape changes.
struct BottleneckImpl : torch::nn::Module {
  BottleneckImpl(int64_t in, int64_t width, int64_t stride) {
    namespace nn = torch::nn;
    const int64_t out = width * 4;
    conv1 = register_module("conv1", nn::Conv2d(nn::Conv2dOptions(in, width, 1).bias(false)));
    bn1 = register_module("bn1", nn::BatchNorm2d(width));
    conv2 = register_module(
        "conv2",
        nn::Conv2d(nn::Conv2dOptions(width, width, 3).stride(stride).padding(1).bias(false)));
    bn2 = register_module("bn2", nn::BatchNorm2d(width));
    conv3 = register_module("conv3", nn::Conv2d(nn::Conv2dOptions(width, out, 1).bias(false)));
    bn3 = register_module("bn3", nn::BatchNorm2d(out));
    if (stride != 1 || in != out)
      downsample = register_module("downsample", shortcut(in, out, stride));
  }
  at::Tensor forward(const at::Tensor& x) {
    auto h = torch::relu(bn1(conv1(x)));
    h = torch::relu(bn2(conv2(h)));
    h = bn3(conv3(h));
    return torch::relu(h + (downsample ? downsample->forward(x) : x));
  }
  torch::nn::Conv2d conv1{nullptr}, conv2{nullptr}, conv3{nullptr};
  torch::nn::BatchNorm2d bn1{nullptr}, bn2{nullptr}, bn3{nullptr};
  torch::nn::Sequential downsample{nullptr};
};
TORCH_MODULE(Bottleneck);

// torchvision's ResNet-50 / ResNet-101 (ImageNet stem: 7x7 stride-2 conv, max-pool).
struct ResNetBottleneckImpl : torch::nn::Module {
  ResNetBottleneckImpl(const ModelOptions& o, std::vector<int> depths) {
    namespace nn = torch::nn;
    conv1 = register_module(
        "conv1",
        nn::Conv2d(nn::Conv2dOptions(o.in_channels, 64, 7).stride(2).padding(3).bias(false)));
    bn1 = register_module("bn1", nn::BatchNorm2d(64));
    int64_t in = 64;
    for (int i = 0; i < 4; ++i) {
      const int64_t width = 64 << i;
      nn::Sequential layer;
      for (int b = 0; b < depths[static_cast<size_t>(i)]; ++b) {
        layer->push_back(Bottleneck(in, width, b == 0 && i > 0 ? 2 : 1));
        in = width * 4;
      }
      layers.push_back(register_module("layer" + std::to_string(i + 1), layer));
    }
    fc = register_module("fc", nn::Linear(2048, o.num_classes));
  }
  at::Tensor forward(const at::Tensor& x) {
    auto h = torch::relu(bn1(conv1(x)));
    h = torch::max_pool2d(h, 3, 2, 1);
    for (auto& l : layers) h = l->forward(h);
    return fc(h.mean({2, 3}));
  }
  torch::nn::Conv2d conv1{nullptr};
  torch::nn::BatchNorm2d bn1{nullptr};
  std::vector<torch::nn::Sequential> layers;
  torch::nn::Linear fc{nullptr};
};

using Parts = BlockParts;  // blocks.h

// Each residual block of the layers, named layer<i>_<j>.
void push_layers(torch::nn::Sequential& seq, const std::vector<torch::nn::Sequential>& layers) {
  for (size_t i = 0; i < layers.size(); ++i) {
    size_t j = 0;
    for (torch::nn::AnyModule block : *layers[i]) {
      seq->push_back("layer" + std::to_string(i + 1) + "_" + std::to_string(j++),
                     Block(Parts{{"block", block.ptr()}},
                           [block](const at::Tensor& x) mutable { return block.forward(x); }));
    }
  }
}

torch::nn::Sequential blocks_of(const std::shared_ptr<ToyModelImpl>& m) {
  return torch::nn::Sequential(
      {{"net1", Block(Parts{{"net1", m->net1.ptr()}},
                      [m](const at::Tensor& x) { return torch::relu(m->net1(x)); })},
       {"net2",
        Block(Parts{{"net2", m->net2.ptr()}}, [m](const at::Tensor& x) { return m->net2(x); })}});
}

torch::nn::Sequential blocks_of(const std::shared_ptr<MLPImpl>& m) {
  return torch::nn::Sequential({{"fc1", Block(Parts{{"fc1", m->fc1.ptr()}, {"drop", m->drop.ptr()}},
                                              [m](const at::Tensor& x) { return m->hidden(x); })},
                                {"fc2", Block(Parts{{"fc2", m->fc2.ptr()}},
                                              [m](const at::Tensor& x) { return m->fc2(x); })}});
}

torch::nn::Sequential blocks_of(const std::shared_ptr<LeNetImpl>& m) {
  return torch::nn::Sequential(
      {{"conv1",
        Block(Parts{{"conv1", m->conv1.ptr()}}, [m](const at::Tensor& x) { return m->stem(x); })},
       {"conv2",
        Block(Parts{{"conv2", m->conv2.ptr()}}, [m](const at::Tensor& x) { return m->second(x); })},
       {"fc1", Block(Parts{{"fc1", m->fc1.ptr()}},
                     [m](const at::Tensor& x) { return torch::relu(m->fc1(x.flatten(1))); })},
       {"fc2",
        Block(Parts{{"fc2", m->fc2.ptr()}}, [m](const at::Tensor& x) { return m->fc2(x); })}});
}

torch::nn::Sequential blocks_of(const std::shared_ptr<ResNet18SmallImpl>& m) {
  torch::nn::Sequential seq;
  seq->push_back("stem", Block(Parts{{"conv1", m->conv1.ptr()}, {"bn1", m->bn1.ptr()}},
                               [m](const at::Tensor& x) { return m->stem(x); }));
  push_layers(seq, m->layers);
  seq->push_back("head", Block(Parts{{"fc", m->fc.ptr()}}, [m](const at::Tensor& x) {
                   return m->fc(x.mean({2, 3}));
                 }));
  return seq;
}

torch::nn::Sequential blocks_of(const std::shared_ptr<ResNetBottleneckImpl>& m) {
  torch::nn::Sequential seq;
  seq->push_back(
      "stem",
      Block(Parts{{"conv1", m->conv1.ptr()}, {"bn1", m->bn1.ptr()}}, [m](const at::Tensor& x) {
        return torch::max_pool2d(torch::relu(m->bn1(m->conv1(x))), 3, 2, 1);
      }));
  push_layers(seq, m->layers);
  seq->push_back("head", Block(Parts{{"fc", m->fc.ptr()}}, [m](const at::Tensor& x) {
                   return m->fc(x.mean({2, 3}));
                 }));
  return seq;
}

template <class M>
Model wrap(const std::string& name, std::shared_ptr<M> m) {
  return {name, m, [m](const at::Tensor& x) { return m->forward(x); },
          [m] { return blocks_of(m); }};
}

}  // namespace

std::vector<std::string> model_names() {
  return {"toy",       "mlp",      "lenet",      "resnet18",  "resnet50",
          "resnet101", "gpt-tiny", "gpt2-small", "llama-tiny"};
}

bool is_llama_name(const std::string& name) {
  return name == "llama-tiny" || (is_hf_folder(name) && hf_model_type(name) != "gpt2");
}

namespace {
ZooMoE zoo_moe(const ModelOptions& o) {
  ZooMoE m;
  m.experts = o.experts;
  m.top_k = o.top_k;
  m.every = o.moe_every;
  m.aux_loss_coef = o.aux_loss_coef;
  return m;
}
}  // namespace

LlamaConfig llama_config_of(const std::string& name, const ModelOptions& o) {
  const bool hf = is_hf_folder(name);
  LlamaConfig c = hf ? llama_config_from_hf(name) : llama_config(name);
  if (o.vocab_size > 0) c.vocab_size = o.vocab_size;
  // Regression (HfFolderOutTookTheRunsContextAsItsPositions): a folder's max_position_embeddings
  // stays its own; --context only shortens the windows.
  if (o.context > 0 && !hf) c.max_positions = o.context;
  c.checkpoint_blocks = o.checkpoint_activations;
  c.moe = zoo_moe(o);
  return c;
}

namespace {
// The zoo's token models as Models: the same wiring whatever the architecture.
template <typename M>
Model token_model(const std::string& name, std::shared_ptr<M> m, bool tied, int64_t flops) {
  Model model{name, m, [m](const at::Tensor& x) { return m->forward(x); }, nullptr};
  if (!tied) model.blocks = [m] { return m->blocks(); };
  model.parallelize = [m](const Dist& tp, bool sp) { m->parallelize(tp, sp); };
  model.context_parallel = [m](const Dist* cp, const ContextSplit& s) {
    m->context_parallel(cp, s);
  };
  model.parallel_loss = [m](const at::Tensor& out, const at::Tensor& y) { return m->loss(out, y); };
  model.output_split = true;
  model.flops_per_sample = flops;
  return model;
}
}  // namespace

Model gpt_model(const std::string& name, const GPTConfig& c) {
  return token_model(name, std::make_shared<GPTImpl>(c), c.tied_head,
                     gpt_flops_per_token(c) * c.block_size);
}

Model llama_model(const std::string& name, const LlamaConfig& c) {
  return token_model(name, std::make_shared<LlamaImpl>(c), c.tied_head,
                     llama_flops_per_token(c) * c.max_positions);
}

// A GPT: the zoo's sizes (an untied head, so that every strategy can split it), or a Hugging
// Face folder's GPT-2 (its config, its head tied as transformers ties it, its weights).
Model make_gpt(const std::string& name, const ModelOptions& o) {
  const bool hf = is_hf_folder(name);
  GPTConfig c = hf ? gpt_config_from_hf(name) : gpt_config(name);
  if (o.vocab_size > 0) c.vocab_size = o.vocab_size;
  if (o.context > 0 && !hf) c.block_size = o.context;  // a folder's positions are its weights'
  c.dropout = o.dropout;
  c.checkpoint_blocks = o.checkpoint_activations;
  c.moe = zoo_moe(o);
  if (!hf) c.tied_head = false;
  Model model = gpt_model(name, c);
  if (hf) {
    auto tensors = gpt_from_hf(read_weights(name));
    if (c.tied_head) tensors.erase("lm_head.weight");  // the same tensor as wte's
    load_state_dict(std::move(tensors), *model.module, name);
  }
  return model;
}

// A Llama: the zoo's size, or a Hugging Face folder's config and weights.
Model make_llama(const std::string& name, const ModelOptions& o) {
  Model model = llama_model(name, llama_config_of(name, o));
  if (is_hf_folder(name)) load_weights(name, *model.module);
  return model;
}

bool is_python_model_name(const std::string& name) {
  const auto ends = [&](const std::string& tail) {
    return name.size() > tail.size() &&
           name.compare(name.size() - tail.size(), tail.size(), tail) == 0;
  };
  return ends(".pt") || ends(".pth") || is_python_model_file(name);
}

Model make_model(const std::string& name, const ModelOptions& o) {
  if (is_python_model_name(name)) return load_python_model(name);
  if (is_llama_name(name)) return make_llama(name, o);
  if (name == "toy") return wrap(name, std::make_shared<ToyModelImpl>());
  if (name == "mlp") return wrap(name, std::make_shared<MLPImpl>(o));
  if (name == "lenet") return wrap(name, std::make_shared<LeNetImpl>(o));
  if (name == "resnet18") return wrap(name, std::make_shared<ResNet18SmallImpl>(o));
  if (name == "resnet50") {
    return wrap(name, std::make_shared<ResNetBottleneckImpl>(o, std::vector<int>{3, 4, 6, 3}));
  }
  if (name == "resnet101") {
    return wrap(name, std::make_shared<ResNetBottleneckImpl>(o, std::vector<int>{3, 4, 23, 3}));
  }
  if (name == "gpt-tiny" || name == "gpt2-small" || is_hf_folder(name)) return make_gpt(name, o);
  std::string known;
  for (auto& n : model_names()) known += (known.empty() ? "" : ", ") + n;
  throw UsageError("unknown model '" + name + "'; the models are: " + known +
                   ", or a TorchScript module's file (FILE.pt, saved by Python's torch.jit.save)");
}

}  // namespace scaletrain
