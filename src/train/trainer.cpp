#include "scaletrain/trainer.h"

#include <signal.h>
#include <sys/resource.h>
#include <torch/nn/functional/loss.h>
#include <torch/optim/adam.h>
#include <torch/optim/sgd.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "scaletrain/amp.h"
#include "scaletrain/checkpoint.h"
#include "scaletrain/data.h"
#include "scaletrain/ddp.h"
#include "scaletrain/error.h"
#include "scaletrain/image_folder.h"
#include "scaletrain/loader.h"
#include "scaletrain/models.h"
#include "scaletrain/sampler.h"
#include "scaletrain/tensorboard.h"
#include "scaletrain/version.h"
#include "train/run_folder.h"

#ifdef SCALETRAIN_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#endif

namespace scaletrain {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

double since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// A split of a data set as the loader sees it: how to build a batch, and its shape.
struct Source {
  BatchFn batches;
  int64_t size = 0;
  int64_t num_classes = 0;
  int64_t channels = 1;
};

Source in_memory(Dataset d, int64_t limit) {
  if (limit > 0 && limit < d.size()) {
    d.images = d.images.narrow(0, 0, limit);
    d.labels = d.labels.narrow(0, 0, limit);
  }
  Source s{nullptr, d.size(), d.num_classes, d.images.size(1)};
  s.batches = batches_of(std::make_shared<const Dataset>(std::move(d)));
  return s;
}

// An image folder split; `limit` keeps a spread of it (every k-th image), so that every class
// stays in.
Source folder(const std::string& root, bool train, const TrainOptions& o, int64_t limit) {
  ImageFolderOptions io;
  io.train = train;
  io.size = o.image_size;
  io.resize = o.image_size * 8 / 7;  // 224 -> 256, as the ImageNet recipes do
  auto f = std::make_shared<const ImageFolder>(root, io);
  Source s{batches_of(f), f->size(), static_cast<int64_t>(f->classes().size()), 3};
  if (limit > 0 && limit < f->size()) {
    const int64_t n = f->size();
    auto inner = s.batches;
    s.batches = [inner, n, limit](const std::vector<int64_t>& idx, uint64_t seed) {
      std::vector<int64_t> spread;
      for (int64_t i : idx) spread.push_back(i * n / limit);
      return inner(spread, seed);
    };
    s.size = limit;
  }
  return s;
}

std::pair<Source, Source> load_data(const TrainOptions& o) {
  if (o.dataset == "fashion-mnist") {
    return {in_memory(load_fashion_mnist(o.data_dir, true), o.limit_train),
            in_memory(load_fashion_mnist(o.data_dir, false), o.limit_test)};
  }
  if (o.dataset == "folder") {
    return {folder(o.data_dir + "/train", true, o, o.limit_train),
            folder(o.data_dir + "/val", false, o, o.limit_test)};
  }
  return {
      in_memory(make_synthetic(o.limit_train > 0 ? o.limit_train : 2048, 1, 28, 28, 10, o.seed + 1),
                0),
      in_memory(make_synthetic(o.limit_test > 0 ? o.limit_test : 512, 1, 28, 28, 10, o.seed + 2),
                0)};
}

at::Device resolve_device(const std::string& name, const Dist& d) {
  const int gpus = cuda_device_count();
  if (name == "cpu" || (name == "auto" && gpus == 0)) return at::kCPU;
  if (gpus == 0) {
    throw UsageError("--device " + name + " on rank " + std::to_string(d.rank()) +
                     ", but no GPU is visible; use --device cpu");
  }
  if (name == "auto" || name == "cuda")
    return {at::kCUDA, static_cast<int8_t>(d.world.local_rank % gpus)};
  at::Device dev(name);
  if (dev.index() >= gpus) {
    throw UsageError("--device " + name + ": this node has " + std::to_string(gpus) + " GPU(s)");
  }
  return dev;
}

int64_t peak_memory(const at::Device& dev) {
#ifdef SCALETRAIN_WITH_CUDA
  if (dev.is_cuda()) {
    auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(dev.index());
    return stats.allocated_bytes[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)]
        .peak;
  }
#endif
  (void)dev;
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  return static_cast<int64_t>(ru.ru_maxrss) * 1024;  // the process's peak resident memory
}

LoaderOptions loader_options(int64_t batch, int workers, const at::Device& dev, uint64_t seed,
                             int64_t first_batch) {
  LoaderOptions lo;
  lo.batch_size = batch;
  lo.workers = workers;
  lo.prefetch = 2;
  lo.pin_memory = dev.is_cuda();
  lo.seed = seed;
  lo.first_batch = first_batch;
  return lo;
}

std::unique_ptr<torch::optim::Optimizer> make_optimizer(const TrainOptions& o, Model& m) {
  if (o.optimizer == "adam") {
    return std::make_unique<torch::optim::Adam>(
        m.module->parameters(), torch::optim::AdamOptions(o.lr).weight_decay(o.weight_decay));
  }
  return std::make_unique<torch::optim::SGD>(
      m.module->parameters(),
      torch::optim::SGDOptions(o.lr).momentum(o.momentum).weight_decay(o.weight_decay));
}

double lr_at(const TrainOptions& o, int64_t epoch) {
  if (o.schedule == "step")
    return o.lr * std::pow(o.gamma, static_cast<double>(epoch / o.step_size));
  if (o.schedule == "cosine") {
    return 0.5 * o.lr * (1 + std::cos(M_PI * static_cast<double>(epoch) / o.epochs));
  }
  return o.lr;
}

void set_lr(torch::optim::Optimizer& opt, double lr) {
  for (auto& g : opt.param_groups()) g.options().set_lr(lr);
}

// Exact accuracy over the test set: every rank scores its sampler slice, padding excluded, and
// the counts are summed.
double evaluate(Model& m, const Source& test, const Dist& d, int64_t batch, const at::Device& dev,
                int workers) {
  torch::NoGradGuard no_grad;
  m.module->eval();
  DistributedSampler s({test.size, d.size(), d.rank(), false, 0, false});
  Loader loader(test.batches, s.indices(), loader_options(batch, workers, dev, 0, 0));
  int64_t correct = 0, counted = 0, position = 0;
  while (auto b = loader.next()) {
    auto hit = m.forward(b->images.to(dev, true)).argmax(1).eq(b->labels.to(dev, true)).cpu();
    auto* h = hit.data_ptr<bool>();
    for (int64_t i = 0; i < hit.size(0); ++i, ++position) {
      if (s.is_padding(position)) continue;
      correct += h[i] ? 1 : 0;
      ++counted;
    }
  }
  m.module->train();
  std::vector<at::Tensor> t{at::tensor({correct, counted}, at::kLong)};
  if (d.backend_name == "nccl") t[0] = t[0].to(dev);
  wait_for(d.backend->allreduce(t), "all-reduce of the test accuracy", d);
  auto counts = t[0].cpu();
  return static_cast<double>(counts[0].item<int64_t>()) /
         static_cast<double>(counts[1].item<int64_t>());
}

void show_progress(int64_t epoch, int64_t done, int64_t total, double loss, double secs) {
  static bool tty = isatty(STDOUT_FILENO) != 0;
  const int width = 30;
  const double frac = total > 0 ? static_cast<double>(done) / static_cast<double>(total) : 1;
  if (tty) {
    int filled = static_cast<int>(frac * width);
    std::printf("\repoch %lld [%s%s] %3d%% loss %.4f %.1fs", static_cast<long long>(epoch + 1),
                std::string(static_cast<size_t>(filled), '#').c_str(),
                std::string(static_cast<size_t>(width - filled), '.').c_str(),
                static_cast<int>(frac * 100), loss, secs);
    if (done == total) std::printf("\n");
    std::fflush(stdout);
  } else if (done == total || done % std::max<int64_t>(1, total / 4) == 0) {
    std::printf("epoch %lld: %lld/%lld batches, loss %.4f, %.1f s\n",
                static_cast<long long>(epoch + 1), static_cast<long long>(done),
                static_cast<long long>(total), loss, secs);
    std::fflush(stdout);
  }
}

// Note [Divergence]: a non-finite loss must stop the run before it writes anything. Under DDP
// the averaged gradients are the same bits on every rank, so checking them (rather than each
// rank's own loss) makes every rank stop at the same step; the weights are checked again
// before every checkpoint and before model.pt, so no file ever holds NaN or inf weights. fp16
// runs leave overflowing steps to the GradScaler, which skips them.
bool all_finite(const std::vector<at::Tensor>& tensors) {
  std::vector<at::Tensor> flags;
  for (const auto& t : tensors) {
    if (t.defined() && t.numel() > 0) flags.push_back(at::isfinite(t).all());
  }
  return flags.empty() || at::stack(flags).all().item<bool>();
}

std::vector<at::Tensor> gradients_of(const torch::nn::Module& m) {
  std::vector<at::Tensor> out;
  for (const auto& p : m.parameters()) out.push_back(p.grad());
  return out;
}

[[noreturn]] void diverged(const std::string& what, int64_t step, int64_t epoch, double loss,
                           const TrainOptions& o, const std::string& last_checkpoint,
                           const Dist& d) {
  std::ostringstream s;
  s << "rank " << d.rank() << ": training diverged at step " << step << " (epoch " << epoch + 1
    << "): " << what << " (the loss was " << loss << "). Nothing was written after that; ";
  if (last_checkpoint.empty()) {
    s << "no checkpoint of this run was written yet. ";
  } else {
    s << "the last checkpoint, written before, is " << last_checkpoint
      << " (--resume it with a lower --lr). ";
  }
  s << "Lower --lr (now " << o.lr << ")"
    << (o.amp == "fp16" ? "" : ", or check the data for inf/NaN values") << ".";
  throw Error(s.str());
}

// Fault injection for the exact-resume test: SCALETRAIN_KILL_AT_STEP=N makes the first attempt
// (TORCHELASTIC_RESTART_COUNT 0) of rank 0 kill itself with SIGKILL after global step N.
int64_t kill_at_step() {
  const char* at = std::getenv("SCALETRAIN_KILL_AT_STEP");
  const char* restart = std::getenv("TORCHELASTIC_RESTART_COUNT");
  if (at == nullptr || (restart != nullptr && std::string(restart) != "0")) return -1;
  return std::atoll(at);
}

std::string shown(double v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%g", v);
  return buf;
}
std::string shown(int64_t v) { return std::to_string(v); }

// A numeric option outside its range: a UsageError naming the flag, the value and the range.
// Written as "must be" conditions so that NaN, which fails every comparison, fails them too.
template <typename T>
void require(bool ok, const char* flag, T value, const char* range) {
  if (!ok) throw UsageError(std::string(flag) + " " + shown(value) + " must be " + range);
}

void validate_numbers(const TrainOptions& o) {
  require(o.lr > 0 && std::isfinite(o.lr), "--lr", o.lr, "a positive finite number, e.g. 0.05");
  require(o.momentum >= 0 && o.momentum < 1, "--momentum", o.momentum,
          "in [0, 1), e.g. 0.9 (0: plain SGD)");
  require(o.weight_decay >= 0 && std::isfinite(o.weight_decay), "--weight-decay", o.weight_decay,
          "0 or a positive finite number, e.g. 5e-4");
  require(o.gamma > 0 && std::isfinite(o.gamma), "--gamma", o.gamma,
          "a positive finite factor, e.g. 0.1");
  require(o.timeout_s > 0 && std::isfinite(o.timeout_s), "--timeout", o.timeout_s,
          "a positive number of seconds");
  require(o.epochs >= 1, "--epochs", int64_t{o.epochs}, "at least 1");
  require(o.accumulate >= 1, "--accumulate", int64_t{o.accumulate},
          "at least 1 (batches per step)");
  require(o.step_size >= 1, "--step-size", int64_t{o.step_size}, "at least 1 epoch");
  require(o.keep >= 1, "--keep", int64_t{o.keep},
          "at least 1: the newest checkpoint is what a resume starts from");
  require(o.limit_train >= 0, "--limit-train", o.limit_train, "0 (every sample) or more");
  require(o.limit_test >= 0, "--limit-test", o.limit_test, "0 (every sample) or more");
  require(o.checkpoint_every >= 0, "--checkpoint-every", int64_t{o.checkpoint_every},
          "0 (at the end of each epoch) or more steps");
  require(o.log_every >= 0, "--log-every", int64_t{o.log_every}, "0 (no step lines) or more");
  require(o.image_size >= 8, "--image-size", o.image_size, "at least 8 pixels");
  require(o.workers >= 0, "--workers", int64_t{o.workers}, "0 or more");
}

}  // namespace

void validate(const TrainOptions& o, int world) {
  validate_numbers(o);
  make_model(o.model);  // throws for an unknown model
  if (o.dataset != "fashion-mnist" && o.dataset != "synthetic" && o.dataset != "folder") {
    throw UsageError("unknown data set '" + o.dataset +
                     "'; use fashion-mnist, synthetic or folder (--data-dir with train/ and val/)");
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
  if (o.device != "auto" && o.device != "cpu" && o.device != "cuda" &&
      o.device.rfind("cuda:", 0) != 0) {
    throw UsageError("unknown --device '" + o.device + "'; use auto, cpu, cuda or cuda:N");
  }
  if (o.amp != "none" && o.amp != "bf16" && o.amp != "fp16") {
    throw UsageError("unknown --amp '" + o.amp + "'; use none, bf16 or fp16");
  }
  if (!o.init_weights.empty() && !fs::exists(o.init_weights)) {
    throw UsageError("--init-weights '" + o.init_weights + "': no such file");
  }
  if (!o.init_weights.empty() && fs::is_directory(o.init_weights)) {
    throw UsageError("--init-weights '" + o.init_weights +
                     "' is a folder; give the weights file in it (a state dict saved by "
                     "torch.save or safetensors, or a model.pt of scaletrain)");
  }
  if (o.batch_size < world) {
    throw UsageError("--batch-size " + std::to_string(o.batch_size) +
                     " is smaller than the world "
                     "size " +
                     std::to_string(world) + ": every rank needs at least one sample");
  }
  if (o.batch_size % world != 0) {
    throw UsageError("--batch-size " + std::to_string(o.batch_size) +
                     " does not split evenly over " + std::to_string(world) +
                     " ranks; use a multiple of the world size");
  }
  if (o.uneven_inputs != "fail" && o.uneven_inputs != "join") {
    throw UsageError("unknown --uneven-inputs '" + o.uneven_inputs + "'; use fail or join");
  }
  if (o.optimizer != "sgd" && o.optimizer != "adam") {
    throw UsageError("unknown optimizer '" + o.optimizer + "'; use sgd or adam");
  }
  if (o.schedule != "none" && o.schedule != "step" && o.schedule != "cosine") {
    throw UsageError("unknown schedule '" + o.schedule + "'; use none, step or cosine");
  }
  std::error_code ec;
  fs::create_directories(o.out_dir, ec);
  const std::string probe = o.out_dir + "/.writable";
  if (ec || !std::ofstream(probe)) {
    throw UsageError("the output folder '" + o.out_dir +
                     "' is not writable; choose another with --out");
  }
  fs::remove(probe, ec);
  if (o.resume != "auto" && o.resume != "none" && !fs::exists(o.resume)) {
    throw UsageError("--resume '" + o.resume + "': no such checkpoint (use auto, none or a file)");
  }
  plan_run_start(o);  // refuses a folder of another run (Note [Run identity])
}

TrainResult train(const TrainOptions& o, const Dist& d) {
  validate(o, d.size());
  const RunStart start = plan_run_start(o);
  const at::Device dev = resolve_device(o.device, d);
  torch::manual_seed(o.seed);
  auto [train_set, test_set] = load_data(o);
  ModelOptions mo;
  mo.num_classes = train_set.num_classes;
  mo.in_channels = train_set.channels;
  Model model = make_model(o.model, mo);
  if (!o.init_weights.empty()) load_weights(o.init_weights, *model.module);
  model.module->to(dev);
  if (o.channels_last) to_channels_last(*model.module);
  DDPOptions ddp_options;
  ddp_options.uneven_inputs = o.uneven_inputs == "join" ? UnevenInputs::kJoin : UnevenInputs::kFail;
  DistributedDataParallel ddp(model.module, d, ddp_options);
  auto opt = make_optimizer(o, model);
  const bool amp = o.amp != "none";
  const at::ScalarType amp_dtype = o.amp == "fp16" ? at::kHalf : at::kBFloat16;
  GradScalerOptions so;
  so.enabled = o.amp == "fp16";  // bf16 has fp32's range: no scaling
  GradScaler scaler(so);
  DistributedSampler sampler({train_set.size, d.size(), d.rank(), true, o.seed, false});
  const int64_t per_rank = o.batch_size / d.size();
  const int64_t eval_batch = o.dataset == "folder" ? 2 * per_rank : 1024;

  // Every rank planned before DDP's construction (a collective), so no rank has written yet.
  TrainingState state;
  state.model_name = o.model;
  const std::optional<std::string> from = start.resume_from;
  TrainResult r;
  r.metrics_path = o.out_dir + "/metrics.jsonl";
  if (from) {
    state = load_checkpoint(*from, *model.module, *opt, o.model);
    std::map<std::string, at::Tensor> scaler_state;  // fp16's loss scale: an exact resume
    for (const auto& [k, t] : state.tensors) {
      if (k.rfind("scaler/", 0) == 0) scaler_state[k.substr(7)] = t;
    }
    scaler.load_state(scaler_state);
    sampler.load_state(state.sampler);
    if (state.run_id.empty()) state.run_id = start.run_id.empty() ? "resumed" : start.run_id;
    r.last_checkpoint = *from;
    if (d.rank() == 0) {
      drop_metrics_after(r.metrics_path, state.global_step);
      std::cout << "resumed from " << *from << " (epoch " << state.epoch + 1 << ", step "
                << state.step_in_epoch << " of it)" << std::endl;
    }
  } else {
    state.run_id = start.run_id;
  }
  if (d.rank() == 0) begin_run(o, start, state.run_id);

  std::ofstream metrics;
  if (d.rank() == 0) metrics.open(r.metrics_path, std::ios::app);
  std::unique_ptr<EventWriter> tb;  // TensorBoard: the same figures as metrics.jsonl
  if (d.rank() == 0 && o.tensorboard) tb = std::make_unique<EventWriter>(o.out_dir);
  const int64_t kill_step = kill_at_step();
  int64_t samples = 0;
  double train_secs = 0;
  for (int64_t epoch = state.epoch; epoch < o.epochs; ++epoch) {
    if (epoch != sampler.epoch()) sampler.set_epoch(epoch);
    set_lr(*opt, lr_at(o, epoch));
    const int64_t batches = (sampler.num_samples() + per_rank - 1) / per_rank;
    int64_t step_in_epoch = sampler.state().position / per_rank;
    // Augmentation differs per epoch and rank, and a resumed epoch sees the same batches.
    const uint64_t loader_seed =
        (o.seed * 1000003 + static_cast<uint64_t>(epoch)) * 1009 + static_cast<uint64_t>(d.rank());
    Loader loader(train_set.batches, sampler.remaining(),
                  loader_options(per_rank, o.workers, dev, loader_seed, step_in_epoch));
    auto t0 = Clock::now();
    double loss_sum = 0;
    int64_t loss_n = 0;
    while (auto batch = loader.next()) {
      const auto rows = batch->labels.size(0);
      auto x = batch->images.to(dev, true);
      if (o.channels_last && x.dim() == 4) x = x.contiguous(at::MemoryFormat::ChannelsLast);
      auto y = batch->labels.to(dev, true);
      const bool last_micro =
          (step_in_epoch + 1) % o.accumulate == 0 || step_in_epoch + 1 == batches;
      at::Tensor loss;
      auto run = [&] {
        at::Tensor out;
        {
          std::optional<Autocast> autocast;
          if (amp) autocast.emplace(dev.type(), amp_dtype);
          out = ddp.forward([&] { return model.forward(x); });
        }
        loss = torch::nn::functional::cross_entropy(out.to(at::kFloat), y);
        scaler.scale(o.accumulate > 1 ? loss / o.accumulate : loss).backward();
      };
      if (last_micro) {
        run();
        if (!so.enabled && !all_finite(gradients_of(*model.module))) {
          diverged("the gradients hold NaN or inf", state.global_step + 1, epoch,
                   loss.item<double>(), o, r.last_checkpoint, d);
        }
        scaler.step(*opt);  // skips a step whose gradients overflowed (fp16)
        scaler.update();
        ddp.zero_grad();  // keeps the gradients as views of the buckets
      } else {
        auto no_sync = ddp.no_sync();
        run();
      }
      sampler.advance(rows);
      ++step_in_epoch;
      ++state.global_step;
      samples += rows * d.size();
      const double step_loss = loss.item<double>();  // one device sync per step, not three
      loss_sum += step_loss;
      ++loss_n;
      if (d.rank() == 0 && o.log_every > 0 && state.global_step % o.log_every == 0) {
        metrics << nlohmann::json{{"kind", "step"},
                                  {"epoch", epoch + 1},
                                  {"step", state.global_step},
                                  {"loss", step_loss},
                                  {"lr", lr_at(o, epoch)}}
                       .dump()
                << "\n"
                << std::flush;
        if (tb) {
          tb->add_scalar("train/loss", step_loss, state.global_step);
          tb->add_scalar("train/lr", lr_at(o, epoch), state.global_step);
        }
      }
      if (d.rank() == 0 && o.progress)
        show_progress(epoch, step_in_epoch, batches, loss_sum / loss_n, since(t0));
      if (o.checkpoint_every > 0 && state.global_step % o.checkpoint_every == 0 && last_micro) {
        state.epoch = epoch;
        state.step_in_epoch = step_in_epoch;
        state.sampler = sampler.state();
        if (!all_finite(model.module->parameters())) {
          diverged("the weights hold NaN or inf", state.global_step, epoch, step_loss, o,
                   r.last_checkpoint, d);
        }
        if (d.rank() == 0) {
          for (const auto& [k, t] : scaler.state()) state.tensors["scaler/" + k] = t;
          save_checkpoint(o.out_dir, state, *model.module, *opt, o.keep);
        }
        r.last_checkpoint = checkpoint_path(o.out_dir, state.global_step);
      }
      if (kill_step > 0 && state.global_step == kill_step && d.rank() == 0) raise(SIGKILL);
    }
    // A rank whose batches ran out says so before anything else collective (Note [Uneven
    // inputs] in ddp.h): with "fail" every rank stops here or in its next step, within a step.
    ddp.join();
    const double secs = since(t0);
    train_secs += secs;
    r.epoch_seconds.push_back(secs);
    r.final_loss = loss_n ? loss_sum / loss_n : 0;
    r.test_accuracy = evaluate(model, test_set, d, eval_batch, dev, o.workers);
    state.epoch = epoch + 1;
    state.step_in_epoch = 0;
    sampler.set_epoch(epoch + 1);
    state.sampler = sampler.state();
    if (!all_finite(model.module->parameters())) {
      diverged("the weights hold NaN or inf", state.global_step, epoch, r.final_loss, o,
               r.last_checkpoint, d);
    }
    if (d.rank() == 0) {
      for (const auto& [k, t] : scaler.state()) state.tensors["scaler/" + k] = t;
      save_checkpoint(o.out_dir, state, *model.module, *opt, o.keep);
    }
    r.last_checkpoint = checkpoint_path(o.out_dir, state.global_step);
    if (d.rank() == 0) {
      metrics << nlohmann::json{{"kind", "epoch"},
                                {"epoch", epoch + 1},
                                {"step", state.global_step},
                                {"loss", r.final_loss},
                                {"test_accuracy", r.test_accuracy},
                                {"seconds", secs}}
                     .dump()
              << "\n"
              << std::flush;
      if (tb) {
        tb->add_scalar("epoch/loss", r.final_loss, state.global_step);
        tb->add_scalar("epoch/test_accuracy", r.test_accuracy, state.global_step);
        tb->add_scalar("epoch/seconds", secs, state.global_step);
      }
      if (o.progress) {
        std::printf("epoch %lld: loss %.4f, test accuracy %.4f, %.1f s\n",
                    static_cast<long long>(epoch + 1), r.final_loss, r.test_accuracy, secs);
        std::fflush(stdout);
      }
    }
  }
  if (r.epoch_seconds.empty()) {
    // Resumed from a checkpoint of a finished run: nothing to train, report where it stands.
    r.test_accuracy = evaluate(model, test_set, d, eval_batch, dev, o.workers);
    r.last_checkpoint = from.value_or("");
    if (d.rank() == 0) {
      std::cout << "all " << o.epochs << " epochs were already trained in " << o.out_dir
                << "; give more --epochs to continue, or --resume none to start again" << std::endl;
    }
  }
  ddp.join();
  if (!all_finite(model.module->parameters())) {
    diverged("the weights hold NaN or inf", state.global_step, o.epochs - 1, r.final_loss, o,
             r.last_checkpoint, d);
  }
  if (d.rank() == 0) {
    r.weights_path = o.out_dir + "/model.pt";
    save_weights(r.weights_path, *model.module);
  }
  r.device = dev.str();
  r.peak_memory_bytes = peak_memory(dev);
  r.global_step = state.global_step;
  r.samples_per_second = train_secs > 0 ? static_cast<double>(samples) / train_secs : 0;
  return r;
}

}  // namespace scaletrain
