// The grid strategy (Note [Strategies] in strategy.cpp): `stages` ranks form a pipeline
// (DistPipeline), world / stages such pipelines train on their own slices of the data, and each
// stage's parameters are averaged over its replicas by DDP in a group of its own.
//
//   rank = replica × stages + stage        e.g. 4 ranks, 2 stages:   stage 0   stage 1
//   (the DeviceMesh {dp, pp}, mesh.h)
//                                                          replica 0   rank 0    rank 1
//                                                          replica 1   rank 2    rank 3
//
// Every rank builds the whole model and trains its stage's blocks; checkpoints gather the
// stages' weights from replica 0 onto every rank (the file holds the whole model under PyTorch's
// names) and each stage's optimizer state onto rank 0.

#include <optional>
#include <set>

#include "scaletrain/ddp.h"
#include "scaletrain/dist_pipeline.h"
#include "scaletrain/error.h"
#include "train/balance.h"
#include "train/strategy.h"

namespace scaletrain {
namespace {

constexpr int kOptimizerTag = 1 << 20;  // point-to-point tags of the optimizer gather

std::string optimizer_key(int stage) { return "grid/optimizer/stage" + std::to_string(stage); }

class GridStrategy : public TrainStrategy {
 public:
  GridStrategy(const TrainTask& task, const TrainerOptions& o, const Dist& d, Model& model,
               const at::Tensor& sample)
      : TrainStrategy(d),
        model_(model),
        loss_(task.loss),
        stages_(o.pipeline_stages),
        replica_(d.rank() / o.pipeline_stages),  // the mesh's coordinates (below)
        stage_(d.rank() % o.pipeline_stages),
        dev_(rank_device(o.device, d)) {
    torch::nn::Sequential chain = chain_of(model);
    // Interleaved: stages_ · v pipeline stages, stage k on rank k mod stages_ as its chunk
    // k / stages_ (each rank's parameters: its chunks', in the model's order).
    const int v = v_ = o.stages_per_device;
    const auto balance = resolve_balance(o.balance, chain, stages_ * v, sample, d, dev_);
    balance_.assign(balance.begin(), balance.end());
    stage_params_.resize(static_cast<size_t>(stages_));
    size_t begin = 0;
    for (int k = 0; k < stages_ * v; ++k) {
      const size_t end = begin + static_cast<size_t>(balance[static_cast<size_t>(k)]);
      auto part = slice(chain, begin, end);
      auto& params = stage_params_[static_cast<size_t>(k % stages_)];
      for (auto& p : part->parameters()) params.push_back(p);
      if (k % stages_ == stage_) chunks_.push_back(part);
      begin = end;
    }
    for (auto& params : stage_params_) params = in_model_order(params);
    stage_module_ = chunks_.front();
    // The mesh {dp, pp}: DDP over this stage's replicas (its "dp" group), the pipeline along
    // this replica's stages (its "pp" group).
    const DeviceMesh mesh({{"dp", d.size() / stages_}, {"pp", stages_}}, d.size());
    group_ = mesh_groups(d, mesh, "grid", {"dp"}).at("dp");
    for (auto& c : chunks_) c->to(dev_);
    if (d.size() > stages_) ddp_ = std::make_unique<DistributedDataParallel>(stage_module_, group_);
    DistPipelineOptions po;
    po.stage_ranks = mesh.group(d.rank(), "pp");
    po.chunks = o.chunks > 0 ? o.chunks : 2 * stages_;
    po.schedule = o.schedule;
    po.device = dev_;
    po.ddp = ddp_.get();
    pipe_ = v > 1 ? std::make_unique<DistPipeline>(chunks_, po, d)
                  : std::make_unique<DistPipeline>(stage_module_, po, d);
  }

  std::vector<at::Tensor> parameters() override {
    return stage_params_[static_cast<size_t>(stage_)];
  }
  int data_rank() const override { return replica_; }
  int data_replicas() const override { return dist_.size() / stages_; }
  at::Device device() const override { return dev_; }

  at::Tensor step(const at::Tensor& x, const at::Tensor& y, bool sync, double weight) override {
    std::optional<DistributedDataParallel::NoSync> local;
    if (!sync && ddp_) local.emplace(*ddp_);
    LossFn loss = loss_;
    if (weight != 1) {
      loss = [this, weight](const at::Tensor& out, const at::Tensor& t) {
        return loss_(out, t) * weight;
      };
    }
    return pipe_->train_step(first() ? x : at::Tensor(), last() ? y : at::Tensor(), loss);
  }

  at::Tensor predict(const at::Tensor& x) override {
    return pipe_->forward(first() ? x : at::Tensor());
  }

  // Each rank holds its stages' gradients, the same in each of the replicas: the world's sum
  // counts every stage once per replica.
  double gradient_square_sum() override {
    return sum_over(dist_, TrainStrategy::gradient_square_sum(), dev_) / data_replicas();
  }
  bool gradients_finite() override {  // every stage's own: agreed over the world
    return on_every_rank(dist_, TrainStrategy::gradients_finite(), dev_);
  }

  void gather_weights() override {
    torch::NoGradGuard no_grad;
    for (int s = 0; s < stages_; ++s) {  // from replica 0's stage s, rank s
      auto& params = stage_params_[static_cast<size_t>(s)];
      auto flat = flat_copy(params, dev_);
      dist_.broadcast(flat, s);
      copy_from_flat(flat, params);
    }
  }

  double reported_loss(double local) override {  // from replica 0's last stage
    auto t = at::full({1}, last() ? local : 0.0, at::kDouble).to(dev_);
    dist_.broadcast(t, stages_ - 1);
    return t.item<double>();
  }

  const torch::optim::Optimizer* saved_optimizer(torch::optim::Optimizer& opt,
                                                 TrainingState& state) override {
    if (replica_ != 0) return nullptr;
    // Replica 0's stages are ranks 0 … stages − 1.
    auto all = bytes_to_rank_zero(dist_, optimizer_bytes(opt), stages_, kOptimizerTag, at::kCPU);
    for (size_t s = 0; s < all.size(); ++s) {
      state.tensors[optimizer_key(static_cast<int>(s))] = all[s];
    }
    if (stage_ == 0) state.values["grid/stages"] = layout();
    return nullptr;  // the stages' states travel in `state`
  }

  bool saved_optimizer_is_standard() const override { return false; }

  bool restore_optimizer(torch::optim::Optimizer& opt, const TrainingState& state) override {
    auto stages = state.values.find("grid/stages");
    auto bytes = state.tensors.find(optimizer_key(stage_));
    if (stages == state.values.end() || stages->second != layout() ||
        bytes == state.tensors.end()) {
      return false;
    }
    load_optimizer_bytes(opt, bytes->second);
    return true;
  }

  void train_mode(bool on) override { model_.module->train(on); }
  std::vector<DeviceReport> devices() const override {
    int64_t n = 0;
    for (auto& p : stage_params_[static_cast<size_t>(stage_)]) n += p.numel();
    return {{dev_.str(), n, peak_memory(dev_)}};
  }

 private:
  // What each stage's optimizer state is over: the stages, the chunks per rank when
  // interleaved, and the blocks per pipeline stage (another layout gives a stage other
  // parameters: the state is not reused).
  std::string layout() const {
    std::string s = std::to_string(stages_) + (v_ == 1 ? "" : "x" + std::to_string(v_)) + ":";
    for (size_t k = 0; k < balance_.size(); ++k) {
      s += (k ? "," : "") + std::to_string(balance_[k]);
    }
    return s;
  }
  bool first() const { return stage_ == 0; }
  bool last() const { return stage_ == stages_ - 1; }

  // `params` (a stage's) in the order the model lists them.
  std::vector<at::Tensor> in_model_order(const std::vector<at::Tensor>& params) const {
    std::set<const void*> mine;
    for (const auto& p : params) mine.insert(p.unsafeGetTensorImpl());
    std::vector<at::Tensor> out;
    for (const auto& p : model_.module->parameters()) {
      if (mine.count(p.unsafeGetTensorImpl())) out.push_back(p);
    }
    return out;
  }

  Model& model_;
  LossFn loss_;
  int stages_, replica_, stage_, v_ = 1;
  std::vector<int64_t> balance_;  // blocks per pipeline stage
  at::Device dev_;
  std::vector<std::vector<at::Tensor>> stage_params_;  // per stage, in the model's order
  torch::nn::Sequential stage_module_{nullptr};        // chunks_[0]: the stage (no interleaving)
  std::vector<torch::nn::Sequential> chunks_;          // this rank's stages, in the model's order
  Dist group_;
  std::unique_ptr<DistributedDataParallel> ddp_;
  std::unique_ptr<DistPipeline> pipe_;
};

}  // namespace

std::unique_ptr<TrainStrategy> make_grid_strategy(const TrainTask& task,
                                                  const TrainerOptions& options, const Dist& dist,
                                                  Model& model, const at::Tensor& sample) {
  return std::make_unique<GridStrategy>(task, options, dist, model, sample);
}

}  // namespace scaletrain
