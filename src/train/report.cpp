#include "train/report.h"

#include <unistd.h>

#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <nlohmann/json.hpp>

#include "scaletrain/log.h"

namespace scaletrain {
namespace {

std::string format(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
std::string format(const char* fmt, ...) {
  char buf[512];
  va_list args;
  va_start(args, fmt);
  std::vsnprintf(buf, sizeof buf, fmt, args);
  va_end(args);
  return buf;
}

}  // namespace

Reporter::Reporter(const TrainerOptions& o, bool active)
    : o_(o), active_(active), metrics_path_(o.out_dir + "/metrics.jsonl") {
  if (!active_) return;
  metrics_.open(metrics_path_, std::ios::app);
  if (o.tensorboard) tb_ = std::make_unique<EventWriter>(o.out_dir);
}

void Reporter::step(int64_t epoch, int64_t done, int64_t total, int64_t global_step, double loss,
                    double mean_loss, double lr, double seconds) {
  if (!active_) return;
  if (o_.log_every > 0 && global_step % o_.log_every == 0 && std::isfinite(loss)) {
    metrics_ << nlohmann::json{{"kind", "step"},
                               {"epoch", epoch + 1},
                               {"step", global_step},
                               {"loss", loss},
                               {"lr", lr}}
                    .dump()
             << "\n"
             << std::flush;
    if (tb_) {
      tb_->add_scalar("train/loss", loss, global_step);
      tb_->add_scalar("train/lr", lr, global_step);
    }
  }
  if (o_.progress) progress(epoch, done, total, mean_loss, seconds);
}

void Reporter::epoch(const EpochReport& r) {
  if (!active_) return;
  nlohmann::json line = {{"kind", "epoch"},
                         {"epoch", r.epoch},
                         {"step", r.global_step},
                         {"loss", r.loss},
                         {"seconds", r.seconds}};
  for (const auto& [name, value] : r.metrics) line[name] = value;
  metrics_ << line.dump() << "\n" << std::flush;
  if (tb_) {
    tb_->add_scalar("epoch/loss", r.loss, r.global_step);
    for (const auto& [name, value] : r.metrics)
      tb_->add_scalar("epoch/" + name, value, r.global_step);
    tb_->add_scalar("epoch/seconds", r.seconds, r.global_step);
  }
  if (o_.progress) {
    std::string text = format("epoch %lld: loss %.4f", static_cast<long long>(r.epoch), r.loss);
    for (const auto& [name, value] : r.metrics) text += format(", %s %.4f", name.c_str(), value);
    log_line(LogLevel::kInfo, text + format(", %.1f s", r.seconds));
  }
}

void Reporter::progress(int64_t epoch, int64_t done, int64_t total, double loss, double secs) {
  static const bool tty = isatty(STDOUT_FILENO) != 0;
  const int width = 30;
  const double frac = total > 0 ? static_cast<double>(done) / static_cast<double>(total) : 1;
  if (tty) {
    const int filled = static_cast<int>(frac * width);
    log_line(
        LogLevel::kProgress,
        format("\repoch %lld [%s%s] %3d%% loss %.4f %.1fs%s", static_cast<long long>(epoch + 1),
               std::string(static_cast<size_t>(filled), '#').c_str(),
               std::string(static_cast<size_t>(width - filled), '.').c_str(),
               static_cast<int>(frac * 100), loss, secs, done == total ? "\n" : ""));
  } else if (done == total || done % std::max<int64_t>(1, total / 4) == 0) {
    log_line(LogLevel::kProgress,
             format("epoch %lld: %lld/%lld batches, loss %.4f, %.1f s\n",
                    static_cast<long long>(epoch + 1), static_cast<long long>(done),
                    static_cast<long long>(total), loss, secs));
  }
}

}  // namespace scaletrain
