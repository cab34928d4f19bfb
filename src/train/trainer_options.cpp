// The trainer's options read from text (the command line's flags, a user's config) and written
// back: the strategy, mixed precision, the pipeline's schedule and checkpointing, devices, the
// resume and the balance.

#include "scaletrain/trainer_options.h"

#include <algorithm>

#include "scaletrain/error.h"
#include "train/balance.h"

namespace scaletrain {

Strategy parse_strategy(const std::string& name) {
  if (name == "ddp") return Strategy::kDDP;
  if (name == "dp") return Strategy::kDataParallel;
  if (name == "pipeline") return Strategy::kPipeline;
  if (name == "grid") return Strategy::kGrid;
  if (name == "zero1") return Strategy::kZero1;
  if (name == "zero2") return Strategy::kZero2;
  if (name == "fsdp") return Strategy::kFsdp;
  throw UsageError("unknown TrainerOptions::strategy '" + name +
                   "'; use ddp, dp, pipeline, grid, zero1, zero2 or fsdp");
}

PipelineTrainOptions::Resolved PipelineTrainOptions::resolved() const {
  Resolved r;
  if (schedule) r.schedule = *schedule;
  if (chunks) r.chunks = *chunks;
  if (split_size) r.split_size = *split_size;
  if (balance) r.balance = *balance;
  if (checkpoint) r.checkpoint = *checkpoint;
  if (stages) r.stages = *stages;
  if (stages_per_device) r.stages_per_device = *stages_per_device;
  return r;
}

std::vector<std::string> PipelineTrainOptions::given(const std::vector<std::string>& except) const {
  const std::pair<bool, const char*> fields[] = {
      {schedule.has_value(), "schedule"},
      {chunks.has_value(), "chunks"},
      {split_size.has_value(), "split_size"},
      {balance.has_value(), "balance"},
      {checkpoint.has_value(), "checkpoint"},
      {stages.has_value(), "stages"},
      {stages_per_device.has_value(), "stages_per_device"}};
  std::vector<std::string> out;
  for (const auto& [set, field] : fields) {
    if (set && std::find(except.begin(), except.end(), field) == except.end())
      out.push_back(std::string("TrainerOptions::pipeline.") + field);
  }
  return out;
}

ParallelDims parallel_dims(const TrainerOptions& o) {
  ParallelDims d;
  d.tp = o.tensor_parallel.size;
  d.cp = o.context_parallel.size;
  d.ep = o.expert_parallel.size;
  switch (o.strategy) {
    case Strategy::kDDP:
      d.dp_replicate = -1;
      break;
    case Strategy::kZero1:
    case Strategy::kZero2:
    case Strategy::kFsdp:
      d.dp_shard = -1;
      d.zero_stage = o.strategy == Strategy::kZero1 ? 1 : o.strategy == Strategy::kZero2 ? 2 : 3;
      break;
    case Strategy::kGrid:
      d.dp_replicate = -1;
      d.pp = o.pipeline.resolved().stages;
      break;
    case Strategy::kDataParallel:
    case Strategy::kPipeline:
      // One process: its devices are threads (validation refuses tp, cp and ep here).
      d.tp = d.cp = d.ep = 1;
      break;
  }
  return d;
}

std::string to_string(Strategy s) {
  switch (s) {
    case Strategy::kDDP:
      return "ddp";
    case Strategy::kDataParallel:
      return "dp";
    case Strategy::kPipeline:
      return "pipeline";
    case Strategy::kGrid:
      return "grid";
    case Strategy::kZero1:
      return "zero1";
    case Strategy::kZero2:
      return "zero2";
    case Strategy::kFsdp:
      return "fsdp";
  }
  return "?";
}

Amp parse_amp(const std::string& name) {
  if (name == "none") return Amp::kNone;
  if (name == "bf16") return Amp::kBf16;
  if (name == "fp16") return Amp::kFp16;
  throw UsageError("unknown TrainerOptions::amp '" + name + "'; use none, bf16 or fp16");
}

std::string to_string(Amp a) {
  switch (a) {
    case Amp::kNone:
      return "none";
    case Amp::kBf16:
      return "bf16";
    case Amp::kFp16:
      return "fp16";
  }
  return "unknown";
}

PipelineSchedule parse_schedule(const std::string& name) {
  if (name == "gpipe") return PipelineSchedule::kGPipe;
  if (name == "1f1b") return PipelineSchedule::k1F1B;
  if (name == "interleaved") return PipelineSchedule::kInterleaved1F1B;
  if (name == "zb-h1") return PipelineSchedule::kZeroBubbleH1;
  throw UsageError("unknown TrainerOptions::pipeline.schedule '" + name +
                   "'; use gpipe, 1f1b, interleaved or zb-h1");
}

std::string to_string(PipelineSchedule s) {
  switch (s) {
    case PipelineSchedule::kGPipe:
      return "gpipe";
    case PipelineSchedule::k1F1B:
      return "1f1b";
    case PipelineSchedule::kInterleaved1F1B:
      return "interleaved";
    case PipelineSchedule::kZeroBubbleH1:
      return "zb-h1";
  }
  return "?";
}

PipelineCheckpoint parse_pipeline_checkpoint(const std::string& name) {
  if (name == "never") return PipelineCheckpoint::kNever;
  if (name == "except-last") return PipelineCheckpoint::kExceptLast;
  if (name == "always") return PipelineCheckpoint::kAlways;
  throw UsageError("unknown TrainerOptions::pipeline.checkpoint '" + name +
                   "'; use never, except-last or always");
}

std::string to_string(PipelineCheckpoint c) {
  switch (c) {
    case PipelineCheckpoint::kNever:
      return "never";
    case PipelineCheckpoint::kExceptLast:
      return "except-last";
    case PipelineCheckpoint::kAlways:
      return "always";
  }
  return "?";
}

c10::Device parse_device(const std::string& name, const std::string& what) {
  try {
    c10::Device d(name);
    if (d.is_cpu() || d.is_cuda()) return d;
  } catch (const std::exception&) {
  }
  throw UsageError("unknown " + what + " '" + name + "'; give cpu, cuda or cuda:N");
}

Resume Resume::parse(const std::string& text) {
  if (text == "auto") return automatic();
  if (text == "none") return none();
  if (text.empty()) {
    throw UsageError("TrainerOptions::resume is empty; give auto, none or a checkpoint file");
  }
  return from(text);
}

std::string Resume::str() const {
  switch (kind) {
    case Kind::kAuto:
      return "auto";
    case Kind::kNone:
      return "none";
    case Kind::kFile:
      return file;
  }
  return "?";
}

Balance Balance::parse(const std::string& text) {
  if (text == "auto" || text == "time") return time();
  if (text == "size") return size();
  return of(parse_balance_list(text));
}

std::string Balance::str() const {
  if (by == By::kTime) return "time";
  if (by == By::kSize) return "size";
  std::string s;
  for (size_t k = 0; k < layers.size(); ++k) s += (k ? "," : "") + std::to_string(layers[k]);
  return s;
}

}  // namespace scaletrain
