// `scaletrain train`'s task: the zoo's models, the built-in data sets, the optimizer and the
// learning-rate schedule by name (TrainOptions in trainer.h), trained by the same trainer as a
// program's own task.

#include <torch/optim/adam.h>
#include <torch/optim/schedulers/step_lr.h>
#include <torch/optim/sgd.h>

#include <cmath>
#include <csignal>
#include <cstdlib>
#include <filesystem>

#include "gpt.h"
#include "hf_folder.h"
#include "scaletrain/checkpoint.h"
#include "scaletrain/context_parallel.h"
#include "scaletrain/data.h"
#include "scaletrain/image_folder.h"
#include "scaletrain/lr_schedule.h"
#include "scaletrain/tokens.h"
#include "scaletrain/trainer.h"
#include "scaletrain_zoo.h"
#include "train/validation.h"

namespace scaletrain {
namespace {

namespace fs = std::filesystem;

// The zoo's models of token ids: the GPTs, the Llama, a Hugging Face folder's Llama.
bool reads_tokens(const std::string& m) {
  return m.rfind("gpt", 0) == 0 || m == "llama-tiny" || is_hf_folder(m);
}

// Their vocabulary and context before --vocab-size and --context.
std::pair<int64_t, int64_t> token_shape(const std::string& m) {
  if (!is_llama_name(m)) {
    const GPTConfig c = is_hf_folder(m) ? gpt_config_from_hf(m) : gpt_config(m);
    return {c.vocab_size, c.block_size};
  }
  const LlamaConfig c = llama_config_of(m);
  return {c.vocab_size, c.max_positions};
}

// A GPT's vocabulary: at least the byte tokens the text data holds, and split evenly over --tp
// (gpt2-small's 50257 rows divide by no degree; nanoGPT pads them to 50304, a multiple of 128).
void validate_vocabulary(const TrainOptions& o) {
  if (is_python_model_name(o.model)) return;  // validate_python_model()
  const bool gpt = reads_tokens(o.model);
  if (o.vocab_size != 0 && !gpt) {
    throw UsageError(
        "--vocab-size is for --model gpt-tiny, gpt2-small, llama-tiny or a Hugging Face folder "
        "(the zoo's other models take no tokens)");
  }
  require(o.vocab_size == 0 || o.vocab_size >= 256, "--vocab-size", o.vocab_size,
          "0 (the model's own) or at least 256 (the text data's byte tokens)");
  if (is_hf_folder(o.model)) {  // its vocabulary and positions are its weights'
    const auto [rows, positions] = token_shape(o.model);
    if (o.vocab_size != 0) {
      throw UsageError("--vocab-size with the Hugging Face folder " + o.model +
                       ": its vocabulary is its weights' (" + std::to_string(rows) +
                       " rows); leave it out");
    }
    if (o.context > positions) {
      throw UsageError("--context " + std::to_string(o.context) + " is longer than " + o.model +
                       "'s " + std::to_string(positions) +
                       " positions (its config's max_position_embeddings or n_positions)");
    }
  }
  if (!gpt || o.tensor_parallel.size <= 1) return;
  if (is_llama_name(o.model)) {  // its key/value heads split over the ranks
    const int64_t kv = llama_config_of(o.model).n_kv_heads;
    if (kv % o.tensor_parallel.size != 0) {
      throw UsageError("--tp " + std::to_string(o.tensor_parallel.size) + " splits " + o.model +
                       "'s " + std::to_string(kv) +
                       " key/value heads (num_key_value_heads), which it does not divide: use a "
                       "degree that divides them");
    }
  }
  const int64_t vocab = o.vocab_size > 0 ? o.vocab_size : token_shape(o.model).first;
  if (vocab % o.tensor_parallel.size != 0) {
    const int64_t padded = (vocab + 127) / 128 * 128;
    const int64_t fix = padded % o.tensor_parallel.size == 0
                            ? padded
                            : (vocab / o.tensor_parallel.size + 1) * o.tensor_parallel.size;
    throw UsageError("--tp " + std::to_string(o.tensor_parallel.size) + " splits " + o.model +
                     "'s vocabulary of " + std::to_string(vocab) +
                     " rows, which it does not divide: pad it with --vocab-size " +
                     std::to_string(fix) + " (rows no token uses, never a target)");
  }
}

void validate_zoo_numbers(const TrainOptions& o) {
  require(o.lr > 0 && std::isfinite(o.lr), "--lr", o.lr, "a positive finite number, e.g. 0.05");
  require(o.momentum >= 0 && o.momentum < 1, "--momentum", o.momentum,
          "in [0, 1), e.g. 0.9 (0: plain SGD)");
  require(o.weight_decay >= 0 && std::isfinite(o.weight_decay), "--weight-decay", o.weight_decay,
          "0 or a positive finite number, e.g. 5e-4");
  require(o.gamma > 0 && std::isfinite(o.gamma), "--gamma", o.gamma,
          "a positive finite factor, e.g. 0.1");
  require(o.step_size >= 1, "--step-size", int64_t{o.step_size}, "at least 1 epoch");
  require(o.limit_train >= 0, "--limit-train", o.limit_train, "0 (every sample) or more");
  require(o.limit_test >= 0, "--limit-test", o.limit_test, "0 (every sample) or more");
  require(o.image_size >= 8, "--image-size", o.image_size, "at least 8 pixels");
  require(o.dropout >= 0 && o.dropout < 1, "--dropout", o.dropout, "in [0, 1), e.g. 0.1");
  require(o.context >= 0, "--context", o.context, "0 (the model's own) or a positive length");
  if (o.context > 0 && !reads_tokens(o.model) && !is_python_model_name(o.model)) {
    throw UsageError(
        "--context is for --model gpt-tiny, gpt2-small, llama-tiny or a Hugging Face folder (the "
        "zoo's other models take no sequences)");
  }
  if (o.dropout > 0 && o.model != "mlp" && o.model.rfind("gpt", 0) != 0) {
    throw UsageError(
        "--dropout is for --model mlp, gpt-tiny and gpt2-small (the zoo's other models have no "
        "dropout)");
  }
}

// Fault injection for the exact-resume tests: SCALETRAIN_KILL_AT_STEP=N makes the first attempt
// (TORCHELASTIC_RESTART_COUNT 0) of rank 0 kill itself with SIGKILL after global step N.
std::function<void(const StepReport&)> kill_at_step_hook() {
  const char* at = std::getenv("SCALETRAIN_KILL_AT_STEP");
  const char* restart = std::getenv("TORCHELASTIC_RESTART_COUNT");
  const char* rank = std::getenv("RANK");
  if (at == nullptr || (restart != nullptr && std::string(restart) != "0") ||
      (rank != nullptr && std::string(rank) != "0")) {
    return {};
  }
  const int64_t step = std::atoll(at);
  return [step](const StepReport& r) {
    if (r.global_step == step) ::raise(SIGKILL);
  };
}

// The zoo's models against the data's shape (the trainer checks any model with one sample too,
// Note [Model against data]; these say which flag to change).
void validate_zoo_shapes(const TrainOptions& o) {
  const bool gpt = reads_tokens(o.model);
  if (gpt != (o.dataset == "text") && !is_python_model_name(o.model)) {
    throw UsageError(gpt ? "--model " + o.model +
                               " reads token ids: give --dataset text (--data-dir with "
                               "train.bin and val.bin, docs/text.md)"
                         : "--dataset text is token ids, for a GPT: give --model gpt-tiny or "
                           "gpt2-small");
  }
  if (o.dropout > 0 && o.pipeline.resolved().checkpoint != PipelineCheckpoint::kNever) {
    throw UsageError(
        "--dropout with --checkpoint-activations: the pipeline's recomputation does not replay "
        "the random generators, so its masks would not be the forward's; leave "
        "--checkpoint-activations at never (a GPT: --checkpoint-blocks replays them)");
  }
  if (o.data_on_device && o.dataset != "fashion-mnist" && o.dataset != "synthetic") {
    throw UsageError("--data-on-device holds an in-memory data set on the device; --dataset " +
                     o.dataset +
                     " is read from files as it trains (use it with fashion-mnist or synthetic, "
                     "or leave --data-on-device out)");
  }
  if (o.checkpoint_blocks && !gpt) {
    throw UsageError("--checkpoint-blocks recomputes a GPT's transformer blocks; --model " +
                     o.model + " has none (give --model gpt-tiny or gpt2-small)");
  }
  if (o.model == "toy") {
    throw UsageError(
        "--model toy takes 10 numbers per sample (seed 000's toy), and the zoo's data sets are "
        "images: use --model mlp, lenet or a resnet");
  }
  if (o.model == "lenet" && o.dataset == "folder" && o.image_size != 28) {
    throw UsageError("--model lenet takes 28x28 images (its fc1 reads 50x4x4), and --image-size " +
                     std::to_string(o.image_size) +
                     " crops the folder's to that size: give --image-size 28, or use --model "
                     "resnet18 (any size)");
  }
}

// A Python model reads what it was written for: the trainer checks it against the data with one
// sample (Note [Model against data]). Token windows need their length and the ids' bound from
// the command line, since the module's own are not known here.
void validate_python_model(const TrainOptions& o) {
  if (!is_python_model_name(o.model)) return;
  if (o.dataset == "text" && (o.context <= 0 || o.vocab_size <= 0)) {
    throw UsageError("--model " + o.model +
                     " with --dataset text: give --context (the sequence length the module "
                     "takes) and --vocab-size (its embedding's rows; every token id is below it)");
  }
  if (o.dataset != "text" && (o.context > 0 || o.vocab_size > 0)) {
    throw UsageError(
        "--context and --vocab-size are for --dataset text (token windows); --dataset " +
        o.dataset + " gives images");
  }
}

void validate_zoo_names(const TrainOptions& o) {
  make_model(o.model);  // throws for an unknown model
  if (o.dataset != "fashion-mnist" && o.dataset != "synthetic" && o.dataset != "folder" &&
      o.dataset != "text") {
    throw UsageError("unknown data set '" + o.dataset +
                     "'; use fashion-mnist, synthetic, folder (--data-dir with train/ and val/) "
                     "or text (--data-dir with train.bin and val.bin)");
  }
  if (o.optimizer != "sgd" && o.optimizer != "adam") {
    throw UsageError("unknown optimizer '" + o.optimizer + "'; use sgd or adam");
  }
  if (o.lr_schedule != "none" && o.lr_schedule != "step" && o.lr_schedule != "cosine") {
    throw UsageError("unknown --lr-schedule '" + o.lr_schedule + "'; use none, step or cosine");
  }
  if (!o.init_weights.empty() && !fs::exists(o.init_weights)) {
    throw UsageError("--init-weights '" + o.init_weights + "': no such file");
  }
  const auto has = [&](const char* file) { return fs::exists(fs::path(o.init_weights) / file); };
  if (!o.init_weights.empty() && fs::is_directory(o.init_weights) && !has(".metadata") &&
      !has("model.safetensors") && !has("model.safetensors.index.json")) {
    throw UsageError("--init-weights '" + o.init_weights +
                     "' is a folder without a .metadata; give a weights file (a state dict saved "
                     "by torch.save or safetensors, or a model.pt of scaletrain), a folder "
                     "written by torch.distributed.checkpoint's dcp.save, or a Hugging Face "
                     "folder (model.safetensors, or its shards and their index)");
  }
}

struct Data {
  DataSource train, test;
  ModelOptions model;  // the classes and channels the data has
};

// Token files: random windows of the model's context from train.bin, and val.bin side by side
// (tokens.h); the vocabulary is the model's own (gpt-tiny: bytes).
Data load_text(const TrainOptions& o) {
  Data d;
  TokenWindowOptions w;
  w.block_size = o.context > 0 ? o.context : token_shape(o.model).second;
  w.samples = o.limit_train;
  w.seed = o.seed;
  // The embedding's rows: an id past them is named with its file and place (tokens.h).
  w.vocab_size = o.vocab_size > 0 ? o.vocab_size : token_shape(o.model).first;
  d.train = token_windows(o.data_dir + "/train.bin", w);
  w.mode = TokenWindowOptions::Mode::kStrided;
  w.samples = 0;
  d.test = token_windows(o.data_dir + "/val.bin", w);
  if (o.limit_test > 0 && o.limit_test < d.test.size) d.test.size = o.limit_test;
  return d;
}

Data load(const TrainOptions& o) {
  if (o.dataset == "text") return load_text(o);
  Data d;
  if (o.dataset == "folder") {
    ImageFolderOptions io;
    io.size = o.image_size;
    io.resize = o.image_size * 8 / 7;  // 224 -> 256, as the ImageNet recipes do
    auto train = std::make_shared<const ImageFolder>(o.data_dir + "/train", io);
    io.train = false;
    auto test = std::make_shared<const ImageFolder>(o.data_dir + "/val", io);
    d.train = image_folder(train, o.limit_train);
    d.test = image_folder(test, o.limit_test);
    d.model.num_classes = static_cast<int64_t>(train->classes().size());
    d.model.in_channels = 3;
    d.model.in_features = 3 * o.image_size * o.image_size;  // an MLP reads the whole image
    return d;
  }
  Dataset train, test;
  if (o.dataset == "fashion-mnist") {
    train = load_fashion_mnist(o.data_dir, true);
    test = load_fashion_mnist(o.data_dir, false);
  } else {
    train = make_synthetic(o.limit_train > 0 ? o.limit_train : 2048, 1, 28, 28, 10, o.seed + 1);
    test = make_synthetic(o.limit_test > 0 ? o.limit_test : 512, 1, 28, 28, 10, o.seed + 2);
  }
  d.model.num_classes = train.num_classes;
  d.model.in_channels = train.inputs.size(1);
  d.model.in_features = train.inputs[0].numel();
  d.train = in_memory(std::move(train), o.limit_train);
  d.test = in_memory(std::move(test), o.limit_test);
  return d;
}

// The data set's files, before the launcher starts any worker (each would fail on the same
// missing file) and before the output folder is made.
void validate_zoo_data(const TrainOptions& o) {
  if (o.dataset == "text") {
    for (const char* split : {"/train.bin", "/val.bin"}) {
      if (!fs::is_regular_file(o.data_dir + split)) {
        throw UsageError("--dataset text needs '" + o.data_dir + split +
                         "': point --data-dir at the folder of train.bin and val.bin (`scaletrain "
                         "data text --input TEXT --out DIR` writes them)");
      }
    }
  }
  // Regression (BackendDeviceAndDataDirWereFoundInTheWorkers): Fashion-MNIST's files were first
  // looked for by the workers, after the launcher had started them (load_fashion_mnist reads these
  // four).
  if (o.dataset == "fashion-mnist") {
    for (const char* file : {"/train-images-idx3-ubyte.gz", "/train-labels-idx1-ubyte.gz",
                             "/t10k-images-idx3-ubyte.gz", "/t10k-labels-idx1-ubyte.gz"}) {
      if (!fs::is_regular_file(o.data_dir + file)) {
        throw UsageError("--dataset fashion-mnist needs '" + o.data_dir + file +
                         "': point --data-dir at the folder of its four IDX .gz files, or "
                         "install Debian's dataset-fashion-mnist (or use --dataset synthetic)");
      }
    }
  }
  if (o.dataset == "folder") {
    for (const char* split : {"/train", "/val"}) {
      if (!fs::is_directory(o.data_dir + split)) {
        throw UsageError("--dataset folder needs '" + o.data_dir + split +
                         "' (one sub-folder per class); point --data-dir at the folder that "
                         "holds train/ and val/");
      }
    }
  }
}

// An explicit --balance against the zoo model's chain (the trainer checks the list's length).
void validate_zoo_balance(const TrainOptions& o) {
  const Balance balance = o.pipeline.resolved().balance;
  if (balance.by != Balance::By::kLayers) return;
  if (o.strategy != Strategy::kPipeline && o.strategy != Strategy::kGrid) return;
  ModelOptions mo;
  if (o.dataset == "folder") mo.in_channels = 3;
  const auto blocks = static_cast<int64_t>(as_sequential(make_model(o.model, mo))->size());
  int64_t total = 0;
  for (int n : balance.layers) total += n;
  if (total != blocks) {
    throw UsageError("--balance '" + balance.str() + "' covers " + std::to_string(total) +
                     " blocks, and " + o.model + " has " + std::to_string(blocks) +
                     " (its chain: as_sequential in models.h)");
  }
}

}  // namespace

// Regression (CpuDevicesOnAGpuMachineAskedNccl): `--strategy dp --devices cpu,cpu` on a machine
// with one GPU joined over NCCL ("auto": a GPU per process), and the trainer's first collective
// on CPU tensors failed. dp and pipeline collect on their first device (the strategies'
// device()); without --devices that is cuda:0 only from 2 GPUs on (local_devices()).
std::string train_backend(const TrainOptions& o, const std::string& requested, int gpus) {
  if (requested != "auto") return requested;
  if (o.device && o.device->is_cpu()) return "gloo";
  if (o.strategy == Strategy::kDataParallel || o.strategy == Strategy::kPipeline) {
    const bool first_on_cpu = o.devices.empty() ? gpus < 2 : o.devices.front().is_cpu();
    if (first_on_cpu) return "gloo";
  }
  return requested;
}

// --cp: a model with attention to split (the GPTs and Llamas: Model::context_parallel) and a
// context the chunks divide (the trainer's ranks would refuse each later).
void validate_zoo_context_parallel(const TrainOptions& o) {
  const int cp = o.context_parallel.size;
  if (cp <= 1) return;
  if (!reads_tokens(o.model) || is_python_model_name(o.model)) {
    throw UsageError("--cp " + std::to_string(cp) + ": --model " + o.model +
                     " has no attention for context parallelism to split; it takes the GPTs "
                     "and Llamas (and Hugging Face folders of them): leave --cp at 1");
  }
  const int64_t chunks = ContextSplit{cp, 0, o.context_parallel.load_balanced}.chunks();
  if (o.context > 0 && o.context % chunks != 0) {
    throw UsageError("--context " + std::to_string(o.context) + " does not cut into " +
                     std::to_string(chunks) + " equal chunks for --cp " + std::to_string(cp) +
                     (o.context_parallel.load_balanced ? " (2 per rank, load-balanced)" : "") +
                     ": give a multiple of " + std::to_string(chunks));
  }
}

// --experts: the zoo's own GPTs and Llama (a folder's weights have dense MLPs), a --top-k and
// an --ep the experts take (the trainer's ranks would refuse each later).
void validate_zoo_experts(const TrainOptions& o) {
  const int ep = o.expert_parallel.size;
  const std::string e = "--experts " + std::to_string(o.experts);
  if (o.experts < 0) throw UsageError(e + ": give 0 (dense MLPs) or a number of experts");
  if (o.experts == 0) {
    if (ep > 1) {
      throw UsageError("--ep " + std::to_string(ep) +
                       " spreads the experts of MoE layers, and the model has none; give "
                       "--experts N (a multiple of --ep) with a GPT or Llama");
    }
    return;
  }
  if (o.model != "gpt-tiny" && o.model != "gpt2-small" && o.model != "llama-tiny") {
    throw UsageError(e + " is for --model gpt-tiny, gpt2-small and llama-tiny (" + o.model +
                     " has no MoE form)");
  }
  if (o.top_k < 1 || o.top_k > o.experts) {
    throw UsageError("--top-k " + std::to_string(o.top_k) + " must be between 1 and " + e +
                     "; route each token to at most as many experts as there are");
  }
  if (o.moe_every < 1) {
    throw UsageError("--moe-every " + std::to_string(o.moe_every) +
                     ": give 1 (every layer a MoE) or more (every n-th)");
  }
  if (!(o.aux_loss_coef >= 0)) {
    throw UsageError("--aux-loss-coef " + std::to_string(o.aux_loss_coef) +
                     ": give 0 (no load-balancing loss) or a positive weight, e.g. 0.01");
  }
  if (o.experts % ep != 0) {
    throw UsageError(e + " does not spread evenly over --ep " + std::to_string(ep) +
                     " ranks; give --experts a multiple of " + std::to_string(ep));
  }
}

void validate(const TrainOptions& o, int world) {
  validate_zoo_numbers(o);
  validate_zoo_names(o);
  validate_python_model(o);
  validate_zoo_data(o);
  validate_zoo_shapes(o);
  validate(static_cast<const TrainerOptions&>(o), world);
  validate_zoo_context_parallel(o);
  validate_zoo_experts(o);
  validate_vocabulary(o);  // after the degree against the world, which comes first
  validate_zoo_balance(o);
}

TrainTask zoo_task(const TrainOptions& o) {
  Data data = load(o);
  TrainTask t;
  t.train_data = data.train;
  t.test_data = data.test;
  data.model.dropout = o.dropout;
  data.model.checkpoint_activations = o.checkpoint_blocks;
  data.model.context = o.context;
  data.model.vocab_size = o.vocab_size;
  data.model.experts = o.experts;
  data.model.top_k = o.top_k;
  data.model.moe_every = o.moe_every;
  data.model.aux_loss_coef = o.aux_loss_coef;
  t.model = [name = o.model, mo = data.model, init = o.init_weights] {
    Model m = make_model(name, mo);
    if (!init.empty()) load_weights(init, *m.module);
    return m;
  };
  t.optimizer = [o](const std::vector<at::Tensor>& p) -> std::unique_ptr<torch::optim::Optimizer> {
    if (o.optimizer == "adam") {
      return std::make_unique<torch::optim::Adam>(
          p, torch::optim::AdamOptions(o.lr).weight_decay(o.weight_decay));
    }
    return std::make_unique<torch::optim::SGD>(
        p, torch::optim::SGDOptions(o.lr).momentum(o.momentum).weight_decay(o.weight_decay));
  };
  if (o.lr_schedule == "step") {
    t.scheduler = [o](torch::optim::Optimizer& opt) {
      return std::make_unique<torch::optim::StepLR>(opt, static_cast<unsigned>(o.step_size),
                                                    o.gamma);
    };
  } else if (o.lr_schedule == "cosine") {
    t.scheduler = [o](torch::optim::Optimizer& opt) {
      return std::make_unique<CosineLR>(opt, o.epochs);
    };
  }
  // Text: next-token accuracy, the per-token loss and its perplexity on val.bin.
  if (o.dataset == "text") t.metrics = {accuracy(), token_loss(), perplexity()};
  t.on_step = kill_at_step_hook();
  return t;
}

namespace {
// OUT/hf from the run's model.pt: the model built again, its weights loaded, written in
// Hugging Face's layout.
void write_hf_out(const TrainOptions& o, const std::string& weights) {
  ModelOptions mo;
  mo.vocab_size = o.vocab_size;
  mo.context = o.context;
  const std::string out = o.out_dir + "/hf";
  if (is_llama_name(o.model)) {
    const LlamaConfig c = llama_config_of(o.model, mo);
    LlamaImpl trained(c);
    load_weights(weights, trained);
    std::vector<std::pair<std::string, at::Tensor>> tensors;
    for (const auto& p : trained.named_parameters()) tensors.emplace_back(p.key(), p.value());
    write_hf_folder(out, hf_config_json(c), tensors);
    return;
  }
  GPTConfig c = gpt_config_from_hf(o.model);
  if (mo.vocab_size > 0) c.vocab_size = mo.vocab_size;
  GPTImpl trained(c);  // its positions the folder's (--context only shortens the windows)
  load_weights(weights, trained);
  write_hf_folder(out, hf_config_json(c), gpt_to_hf(trained));
}
}  // namespace

TrainResult train(const TrainOptions& o, const Dist& d) {
  validate(o, d.size());
  TrainResult r = train(zoo_task(o), o, d);
  // A Llama's or a Hugging Face GPT-2's weights also as a Hugging Face folder, for
  // transformers' from_pretrained.
  // (Not with MoE layers, which Hugging Face's Llama and GPT-2 do not have.)
  if (d.rank() == 0 && !r.left_behind && o.experts == 0 &&
      (is_llama_name(o.model) || is_hf_folder(o.model))) {
    write_hf_out(o, r.weights_path);
  }
  return r;
}

}  // namespace scaletrain
