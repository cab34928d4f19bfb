#include "scaletrain/trainer.h"

#include <signal.h>
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

#include "scaletrain/checkpoint.h"
#include "scaletrain/data.h"
#include "scaletrain/ddp.h"
#include "scaletrain/error.h"
#include "scaletrain/models.h"
#include "scaletrain/sampler.h"

namespace scaletrain {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

double since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

std::pair<Dataset, Dataset> load_data(const TrainOptions& o) {
  Dataset tr, te;
  if (o.dataset == "fashion-mnist") {
    tr = load_fashion_mnist(o.data_dir, true);
    te = load_fashion_mnist(o.data_dir, false);
  } else {
    tr = make_synthetic(o.limit_train > 0 ? o.limit_train : 2048, 1, 28, 28, 10, o.seed + 1);
    te = make_synthetic(o.limit_test > 0 ? o.limit_test : 512, 1, 28, 28, 10, o.seed + 2);
  }
  auto cut = [](Dataset& d, int64_t n) {
    if (n > 0 && n < d.size()) {
      d.images = d.images.narrow(0, 0, n);
      d.labels = d.labels.narrow(0, 0, n);
    }
  };
  cut(tr, o.limit_train);
  cut(te, o.limit_test);
  return {tr, te};
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
double evaluate(Model& m, const Dataset& test, const Dist& d, int64_t batch) {
  torch::NoGradGuard no_grad;
  m.module->eval();
  DistributedSampler s({test.size(), d.size(), d.rank(), false, 0, false});
  auto idx = s.indices();
  int64_t correct = 0, counted = 0;
  for (size_t start = 0; start < idx.size(); start += static_cast<size_t>(batch)) {
    size_t end = std::min(idx.size(), start + static_cast<size_t>(batch));
    std::vector<int64_t> part(idx.begin() + static_cast<long>(start),
                              idx.begin() + static_cast<long>(end));
    auto [x, y] = gather_batch(test, part);
    auto hit = m.forward(x).argmax(1).eq(y);
    for (size_t i = start; i < end; ++i) {
      if (s.is_padding(static_cast<int64_t>(i))) continue;
      correct += hit[static_cast<int64_t>(i - start)].item<bool>() ? 1 : 0;
      ++counted;
    }
  }
  m.module->train();
  std::vector<at::Tensor> t{at::tensor({correct, counted}, at::kLong)};
  wait_for(d.backend->allreduce(t), "all-reduce of the test accuracy", d);
  return static_cast<double>(t[0][0].item<int64_t>()) /
         static_cast<double>(t[0][1].item<int64_t>());
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

// Fault injection for the exact-resume test: SCALETRAIN_KILL_AT_STEP=N makes the first attempt
// (TORCHELASTIC_RESTART_COUNT 0) of rank 0 kill itself with SIGKILL after global step N.
int64_t kill_at_step() {
  const char* at = std::getenv("SCALETRAIN_KILL_AT_STEP");
  const char* restart = std::getenv("TORCHELASTIC_RESTART_COUNT");
  if (at == nullptr || (restart != nullptr && std::string(restart) != "0")) return -1;
  return std::atoll(at);
}

}  // namespace

void validate(const TrainOptions& o, int world) {
  make_model(o.model);  // throws for an unknown model
  if (o.dataset != "fashion-mnist" && o.dataset != "synthetic") {
    throw UsageError("unknown data set '" + o.dataset + "'; use fashion-mnist or synthetic");
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
  if (o.epochs < 1 || o.accumulate < 1 || o.lr <= 0) {
    throw UsageError("--epochs, --accumulate and --lr must be positive");
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
}

TrainResult train(const TrainOptions& o, const Dist& d) {
  validate(o, d.size());
  torch::manual_seed(o.seed);
  Model model = make_model(o.model);
  auto [train_set, test_set] = load_data(o);
  DistributedDataParallel ddp(model.module, d);
  auto opt = make_optimizer(o, model);
  DistributedSampler sampler({train_set.size(), d.size(), d.rank(), true, o.seed, false});
  const int64_t per_rank = o.batch_size / d.size();

  TrainingState state;
  state.model_name = o.model;
  std::optional<std::string> from;
  if (o.resume == "auto")
    from = newest_valid_checkpoint(o.out_dir);
  else if (o.resume != "none")
    from = o.resume;
  if (from) {
    state = load_checkpoint(*from, *model.module, *opt, o.model);
    sampler.load_state(state.sampler);
    if (d.rank() == 0) {
      std::cout << "resumed from " << *from << " (epoch " << state.epoch + 1 << ", step "
                << state.step_in_epoch << " of it)" << std::endl;
    }
  }

  TrainResult r;
  r.metrics_path = o.out_dir + "/metrics.jsonl";
  std::ofstream metrics;
  if (d.rank() == 0) metrics.open(r.metrics_path, std::ios::app);
  const int64_t kill_step = kill_at_step();
  int64_t samples = 0;
  double train_secs = 0;
  for (int64_t epoch = state.epoch; epoch < o.epochs; ++epoch) {
    if (epoch != sampler.epoch()) sampler.set_epoch(epoch);
    set_lr(*opt, lr_at(o, epoch));
    auto idx = sampler.remaining();
    const int64_t batches = (sampler.num_samples() + per_rank - 1) / per_rank;
    int64_t step_in_epoch = sampler.state().position / per_rank;
    auto t0 = Clock::now();
    double loss_sum = 0;
    int64_t loss_n = 0;
    for (size_t start = 0; start < idx.size(); start += static_cast<size_t>(per_rank)) {
      size_t end = std::min(idx.size(), start + static_cast<size_t>(per_rank));
      std::vector<int64_t> part(idx.begin() + static_cast<long>(start),
                                idx.begin() + static_cast<long>(end));
      auto [x, y] = gather_batch(train_set, part);
      const bool last_micro =
          (step_in_epoch + 1) % o.accumulate == 0 || step_in_epoch + 1 == batches;
      at::Tensor loss;
      auto run = [&] {
        auto out = ddp.forward([&] { return model.forward(x); });
        loss = torch::nn::functional::cross_entropy(out, y);
        (o.accumulate > 1 ? loss / o.accumulate : loss).backward();
      };
      if (last_micro) {
        run();
        opt->step();
        ddp.zero_grad();  // keeps the gradients as views of the buckets
      } else {
        auto no_sync = ddp.no_sync();
        run();
      }
      sampler.advance(static_cast<int64_t>(part.size()));
      ++step_in_epoch;
      ++state.global_step;
      samples += static_cast<int64_t>(part.size()) * d.size();
      loss_sum += loss.item<double>();
      ++loss_n;
      if (d.rank() == 0 && o.log_every > 0 && state.global_step % o.log_every == 0) {
        metrics << nlohmann::json{{"kind", "step"},
                                  {"epoch", epoch + 1},
                                  {"step", state.global_step},
                                  {"loss", loss.item<double>()},
                                  {"lr", lr_at(o, epoch)}}
                       .dump()
                << "\n"
                << std::flush;
      }
      if (d.rank() == 0 && o.progress)
        show_progress(epoch, step_in_epoch, batches, loss_sum / loss_n, since(t0));
      if (o.checkpoint_every > 0 && state.global_step % o.checkpoint_every == 0 && last_micro) {
        state.epoch = epoch;
        state.step_in_epoch = step_in_epoch;
        state.sampler = sampler.state();
        if (d.rank() == 0)
          r.last_checkpoint = save_checkpoint(o.out_dir, state, *model.module, *opt, o.keep);
      }
      if (kill_step > 0 && state.global_step == kill_step && d.rank() == 0) raise(SIGKILL);
    }
    const double secs = since(t0);
    train_secs += secs;
    r.epoch_seconds.push_back(secs);
    r.final_loss = loss_n ? loss_sum / loss_n : 0;
    r.test_accuracy = evaluate(model, test_set, d, 1024);
    state.epoch = epoch + 1;
    state.step_in_epoch = 0;
    sampler.set_epoch(epoch + 1);
    state.sampler = sampler.state();
    if (d.rank() == 0) {
      r.last_checkpoint = save_checkpoint(o.out_dir, state, *model.module, *opt, o.keep);
      metrics << nlohmann::json{{"kind", "epoch"},
                                {"epoch", epoch + 1},
                                {"step", state.global_step},
                                {"loss", r.final_loss},
                                {"test_accuracy", r.test_accuracy},
                                {"seconds", secs}}
                     .dump()
              << "\n"
              << std::flush;
      if (o.progress) {
        std::printf("epoch %lld: loss %.4f, test accuracy %.4f, %.1f s\n",
                    static_cast<long long>(epoch + 1), r.final_loss, r.test_accuracy, secs);
        std::fflush(stdout);
      }
    }
  }
  if (r.epoch_seconds.empty()) {
    // Resumed from a checkpoint of a finished run: nothing to train, report where it stands.
    r.test_accuracy = evaluate(model, test_set, d, 1024);
    r.last_checkpoint = from.value_or("");
    if (d.rank() == 0) {
      std::cout << "all " << o.epochs << " epochs were already trained in " << o.out_dir
                << "; give more --epochs to continue, or --resume none to start again" << std::endl;
    }
  }
  ddp.join();
  r.global_step = state.global_step;
  r.samples_per_second = train_secs > 0 ? static_cast<double>(samples) / train_secs : 0;
  return r;
}

}  // namespace scaletrain
