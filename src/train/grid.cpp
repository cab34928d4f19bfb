// The grid strategy (Note [Strategies] in strategy.cpp): `stages` ranks form a pipeline
// (DistPipeline), the pipelines train on their own slices of the data, and each stage's
// parameters are averaged over its replicas by DDP in a group of its own. With
// TrainerOptions::tensor_parallel.size = t > 1 each stage is split over t ranks besides (3D: the
// mesh {dp, pp, tp}, Note [Grid with tensor parallelism]).
//
//   rank = (replica × stages + stage) × t + tp     e.g. 4 ranks, 2 stages:   stage 0   stage 1
//   (the DeviceMesh {dp, pp, tp}, mesh.h)
//                                                          replica 0   rank 0    rank 1
//                                                          replica 1   rank 2    rank 3
//
// With TrainerOptions::context_parallel.size c > 1 each stage's sequences are cut over c ranks
// besides (Note [Context parallelism applied after tensor parallelism] in tp_apply.h): the mesh
// {dp, cp, pp, tp}, here {dp · cp, pp, tp} (the same ranks in the same places), so that DDP
// averages each stage over its replicas and its cp ranks; the first stage takes its rank's slice
// of the inputs, the last its slice of the targets, and each stage's attention runs over its cp
// group, whose ranks run the same schedule.
//
// Every rank builds the whole model and trains its stage's blocks; checkpoints gather the
// stages' weights from replica 0 onto every rank (the file holds the whole model under PyTorch's
// names) and the optimizer state of each stage onto rank 0.
//
// Note [Grid with tensor parallelism]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The dimensions are applied in order: tensor parallelism first (TpApplied, Note [Tensor
// parallelism applied first] in tp_apply.h, on this mesh), then the pipeline cuts what it gave
// into stages, then DDP goes over each stage's replicas. The trainer's Model stays whole on the
// CPU for checkpoints, and at t > 1 a second build of it, given rank 0's weights and split over
// the rank's tp group (Model::parallelize), is the one cut into stages and trained. A stage's tp
// ranks run the same pipeline tasks in step (their stage_ranks differ only in the tp coordinate),
// so the split layers' collectives meet; activations go from a stage's tp rank k to the next
// stage's tp rank k. The last stage takes the model's parallel loss (vocabulary-parallel cross
// entropy). Sequence parallelism's sum of the replicated gradients over tp runs once per step,
// after its last backward, in one all-reduce (the plan's hooks defer to it, Note [Partial gradients
// summed in backward] in src/tp/sequence_parallel.cpp): it commutes with DDP's average over dp.
// gather_weights() assembles each stage's slices over tp and broadcasts them from replica 0;
// weights_loaded() cuts a checkpoint's whole weights again, so a checkpoint moves between any grid,
// tp degree and strategy. The optimizer state goes into a checkpoint as the standard optimizer's
// over the whole model (each stage's slices joined over tp, then gathered onto rank 0: Note
// [Standard optimizer state] in optimizer_states.h), so it goes on at any layout and degree, and
// under any strategy.

#include <map>
#include <optional>
#include <set>
#include <string>

#include "checkpoint/checkpoint_dcp.h"
#include "scaletrain/amp.h"
#include "scaletrain/ddp.h"
#include "scaletrain/dist_pipeline.h"
#include "scaletrain/error.h"
#include "scaletrain/mesh.h"
#include "scaletrain/tensor_parallel.h"
#include "train/balance.h"
#include "train/loss_sums.h"
#include "train/optimizer_states.h"
#include "train/own_boxes.h"
#include "train/strategy.h"
#include "train/tp_apply.h"

namespace scaletrain {
namespace {

constexpr int kOptimizerTag = 1 << 20;            // point-to-point tags of the optimizer gather
const char* kDegreeKey = "grid/tensor_parallel";  // the tp degree of the optimizer states

// A stage's optimizer state; with tensor parallelism, its tp rank's.
std::string optimizer_key(int stage, int tp, int degree) {
  return "grid/optimizer/stage" + std::to_string(stage) +
         (degree > 1 ? "/tp" + std::to_string(tp) : "");
}

// The grid's mesh {dp, pp, tp}, its "dp" being dp x cp flattened under context parallelism (the
// ranks that average a stage's gradients: ParallelDims' {dp, cp, pp, tp} puts them in the same
// places).
DeviceMesh grid_mesh(const TrainerOptions& o, const Dist& d) {
  const ParallelDims dims = parallel_dims(o).resolve(d.size());
  return DeviceMesh({{"dp", dims.dp_cp()}, {"pp", dims.pp}, {"tp", dims.tp}}, d.size());
}

class GridStrategy : public TrainStrategy, StrategyState {
 public:
  GridStrategy(const TrainTask& task, const TrainerOptions& o, const Dist& d, Model& model,
               const at::Tensor& sample)
      : TrainStrategy(d),
        stages_(o.pipeline.resolved().stages),
        degree_(std::max(o.tensor_parallel.size, 1)),
        mesh_(grid_mesh(o, d)),
        replica_(mesh_.coordinate(d.rank(), "dp")),
        stage_(mesh_.coordinate(d.rank(), "pp")),
        dev_(rank_device(o.device, d)),
        bf16_(o.amp == Amp::kBf16),
        // The mesh {dp, pp, tp}: the split over "tp" first, then the pipeline along this
        // replica's stages (its "pp" group), then DDP over this stage's replicas (its "dp" group).
        tp_(task, o, d, model, dev_, mesh_,
            mesh_groups(d, mesh_, "grid",
                        degree_ > 1 ? std::vector<std::string>{"dp", "tp"}
                                    : std::vector<std::string>{"dp"})) {
    // Interleaved: stages_ · v pipeline stages, stage k on rank k mod stages_ as its chunk
    // k / stages_ (each rank's parameters: its chunks', in the model's order).
    const auto p = o.pipeline.resolved();  // the pipeline's options, defaults filled in
    const int v = v_ = p.stages_per_device;
    const auto balance = resolve_balance(p.balance, chain_of(tp_.whole(), Strategy::kGrid),
                                         stages_ * v, sample, d, dev_);
    const int cp = std::max(o.context_parallel.size, 1);
    if (cp > 1) {  // after the balance, which times the whole sequence
      const ParallelDims dims = parallel_dims(o).resolve(d.size());
      tp_.apply_context(
          o, mesh_groups(d, dims.mesh({"dp", "cp", "pp", "tp"}), "grid_context", {"cp"}).at("cp"));
    }
    balance_.assign(balance.begin(), balance.end());
    stage_params_ = stage_parameters(tp_.trained(), &chunks_);
    // The whole model's, which checkpoints gather (the same tensors without a split).
    whole_stage_params_ = tp_.split() ? stage_parameters(tp_.whole(), nullptr) : stage_params_;
    for (const auto& t : parameters()) in_stage_.insert(t.unsafeGetTensorImpl());
    stage_module_ = chunks_.front();
    for (auto& c : chunks_) c->to(dev_);
    if (mesh_.size("dp") > 1) {
      ddp_ = std::make_unique<DistributedDataParallel>(stage_module_, tp_.dp(), o.ddp);
    }
    DistPipelineOptions po;
    po.stage_ranks = mesh_.group(d.rank(), "pp");
    po.chunks = p.chunks > 0 ? p.chunks : 2 * stages_;
    po.schedule = p.schedule;
    po.device = dev_;
    po.ddp = ddp_.get();
    po.checkpoint = p.checkpoint;
    pipe_ = v > 1 ? std::make_unique<DistPipeline>(chunks_, po, d)
                  : std::make_unique<DistPipeline>(stage_module_, po, d);
    // The last stage computes the loss, each of its tp ranks the same (Note [Global losses]).
    // A cp group's ranks read their replica's batch, each counting its slice's loss.
    place({dev_, replica_ / cp, mesh_.size("dp") / cp,
           last() && mesh_.coordinate(d.rank(), "tp") == 0});
  }

  std::vector<at::Tensor> parameters() override {
    return stage_params_[static_cast<size_t>(stage_)];
  }
  StrategyState& state() override { return *this; }

  at::Tensor step(const at::Tensor& x, const at::Tensor& y, bool sync, double weight) override {
    std::optional<DistributedDataParallel::NoSync> local;
    if (!sync && ddp_) local.emplace(*ddp_);
    tp_.set_aux_loss_scale(weight);
    LossFn loss = tp_.loss();
    if (bf16_) {  // the loss in float32, as ddp's under autocast
      loss = [base = loss](const at::Tensor& out, const at::Tensor& t) {
        return base(out.to(at::kFloat), t);
      };
    }
    if (weight != 1) {
      loss = [base = loss, weight](const at::Tensor& out, const at::Tensor& t) {
        return base(out, t) * weight;
      };
    }
    // Note [Grid under autocast]: every task of the schedule runs on this thread, so one scope
    // covers the stage's forwards (and a GPT's recomputed blocks, which replay it); activations
    // and their gradients travel in bf16 (the shapes' protocol carries their dtype), weights,
    // their gradients, DDP's sums over the stage's replicas and the optimizer stay float32.
    std::optional<Autocast> autocast;
    if (bf16_) autocast.emplace(dev_.type(), at::kBFloat16);
    auto out = pipe_->train_step(first() ? tp_.context_slice(x) : at::Tensor(),
                                 last() ? tp_.context_slice(y) : at::Tensor(), loss);
    // Once per step, after its last backward: over what the step accumulated (Note [Partial
    // gradients summed in backward]: it commutes with DDP's average over dp).
    if (sync) tp_.after_last_backward();
    return out.defined() && weight != 1 ? out / weight : out;  // the batch's own loss
  }

  at::Tensor predict(const at::Tensor& x) override {
    at::Tensor out = pipe_->forward(first() ? tp_.context_slice(x) : at::Tensor());
    return out.defined() ? tp_.whole_outputs(out) : out;
  }
  at::Tensor loss_weight_of(const at::Tensor& y) const override {
    return loss_weight(tp_.context_slice(y));
  }

  // Each rank holds its stages' gradients, the same in each of the replicas: the world's sum
  // counts every stage once per replica. Split parameters hold a slice on each tp rank,
  // replicated ones the whole gradient on each (counted 1/t there).
  double gradient_square_sum() override {
    const auto params = parameters();
    std::vector<at::Tensor> grads;
    for (const auto& p : params) grads.push_back(p.grad());
    const double mine = tp_.square_sum(params, grads);
    return sum_over(dist_, mine, dev_) / mesh_.size("dp");  // replicas x cp ranks
  }
  bool gradients_finite() override {  // every stage's own: agreed over the world
    return on_every_rank(dist_, TrainStrategy::gradients_finite(), dev_);
  }

  void gather_weights() override {
    // This rank's stages' slices assembled over tp into the whole model (the other stages'
    // blocks of the split build stay on the CPU, untrained), then each stage's from its owner.
    tp_.gather_weights(chunks_);
    torch::NoGradGuard no_grad;
    for (int s = 0; s < stages_; ++s) {  // from replica 0's stage s (its tp rank 0)
      auto& params = whole_stage_params_[static_cast<size_t>(s)];
      auto flat = flat_copy(params, dev_);
      dist_.broadcast(flat, mesh_.rank_at({0, s, 0}));
      copy_from_flat(flat, params);
    }
  }
  void weights_loaded() override { tp_.weights_loaded(); }

  bool weights_finite() override { return all_finite(parameters()); }

  // Note [Standard optimizer state]: each stage's state (its slices joined over tp) onto rank 0,
  // as the standard optimizer's over the whole model, which a grid of any layout, any other
  // strategy and Python take. An optimizer of another kind saves each stage's bytes, which load
  // at the same layout and degree only.
  const torch::optim::Optimizer* saved_optimizer(torch::optim::Optimizer& opt,
                                                 TrainingState& state) override {
    whole_opt_ = standard_optimizer(opt, whole_module());
    if (!whole_opt_) return save_optimizer_bytes(opt, state);
    if (replica_ != 0) return nullptr;
    // Replica 0's stages (and their tp ranks) are ranks 0 … stages · t − 1.
    NamedStates mine = tp_.join(named_states(opt, trained()));
    if (mesh_.coordinate(dist_.rank(), "tp") != 0) mine.clear();  // tp rank 0 sends the stage's
    auto all = bytes_to_rank_zero(dist_, states_to_bytes(mine), stages_ * degree_, kOptimizerTag,
                                  at::kCPU);
    NamedStates stages;
    for (const auto& bytes : all) {
      for (auto& [name, st] : states_from_bytes(bytes)) stages[name] = std::move(st);
    }
    set_named_states(*whole_opt_, whole_module(), stages);
    return whole_opt_.get();  // rank 0's, which writes the checkpoint
  }
  torch::optim::Optimizer* optimizer_to_load(torch::optim::Optimizer& opt) override {
    whole_opt_ = standard_optimizer(opt, whole_module());
    return whole_opt_.get();
  }
  bool restore_optimizer(torch::optim::Optimizer& opt, const TrainingState& state) override {
    if (state.optimizer_restored && whole_opt_) {  // any layout: this rank's stages' slices
      const auto all = tp_.slice(named_states(*whole_opt_, whole_module()));
      whole_opt_.reset();
      NamedStates mine;
      for (const auto& p : trained().named_parameters()) {
        auto it = all.find(p.key());
        if (it != all.end() && in_stage_.count(p.value().unsafeGetTensorImpl())) {
          mine.insert(*it);
        }
      }
      set_named_states(opt, trained(), mine);
      return true;
    }
    auto stages = state.values.find("grid/stages");  // each stage's bytes (another optimizer)
    auto degree = state.values.find(kDegreeKey);     // absent: 1
    if ((degree == state.values.end() ? "1" : degree->second) != std::to_string(degree_)) {
      return false;
    }
    auto bytes =
        state.tensors.find(optimizer_key(stage_, mesh_.coordinate(dist_.rank(), "tp"), degree_));
    if (stages == state.values.end() || stages->second != layout() ||
        bytes == state.tensors.end()) {
      return false;
    }
    load_optimizer_bytes(opt, bytes->second);
    return true;
  }

  void describe_layout(TrainingState& state) const override {
    state.values["grid/stages"] = layout();  // the split a resume keeps
    // Always: a resume keeps the loaded file's values, and a stale degree would refuse every
    // later restore. Regression (GridStaleDegreeDroppedTheOptimizerState).
    state.values[kDegreeKey] = std::to_string(degree_);
  }

  // Note [Checkpoints every rank writes] in own_boxes.h: each rank its stages' parameters (their
  // slices, split), their optimizer state and their blocks' buffers; the replicas' are the same
  // (the lowest rank's are written).
  std::optional<DcpState> own_boxes(const torch::optim::Optimizer& opt) override {
    if (!writes_own_boxes(opt)) return std::nullopt;
    OwnBoxes boxes(trained(), tp_.split() ? &tp_.tp() : nullptr, opt);
    for (const auto& p : trained().named_parameters()) {
      if (!in_stage_.count(p.value().unsafeGetTensorImpl())) continue;
      boxes.add(p.key(), whole(p.value().sizes().vec()), p.value(),
                param_state(opt, p.value()).value_or(ParamState{}));
    }
    // This rank's blocks' buffers, and those of no block (every rank's), by the model's names.
    std::set<const void*> mine, blocks;
    for (auto& chunk : chunks_) {
      for (const auto& b : chunk->buffers()) mine.insert(b.unsafeGetTensorImpl());
    }
    for (const auto& b : chain_of(tp_.trained(), Strategy::kGrid)->buffers()) {
      blocks.insert(b.unsafeGetTensorImpl());
    }
    for (const auto& b : trained().buffers()) {
      if (!blocks.count(b.unsafeGetTensorImpl())) mine.insert(b.unsafeGetTensorImpl());
    }
    for (const auto& b : trained().named_buffers()) {
      if (mine.count(b.value().unsafeGetTensorImpl())) boxes.add_buffer(b.key(), b.value());
    }
    DcpState out = boxes.take();
    out.values = dcp_optimizer_values(whole_module(), *standard_optimizer(opt, whole_module()));
    return out;
  }

  void train_mode(bool on) override { trained().train(on); }
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

  // The whole model's parameters of each stage, in the model's order.
  // `model`'s chain cut by the balance into pipeline stages k = 0 … stages · v − 1, stage k on
  // rank k mod stages: each rank's parameters, in the model's order; this rank's stages, as
  // chunks in the model's order, into `mine` where given.
  std::vector<std::vector<at::Tensor>> stage_parameters(
      const Model& model, std::vector<torch::nn::Sequential>* mine) const {
    torch::nn::Sequential chain = chain_of(model, Strategy::kGrid);
    std::vector<std::vector<at::Tensor>> out(static_cast<size_t>(stages_));
    size_t begin = 0;
    for (size_t k = 0; k < balance_.size(); ++k) {
      const size_t end = begin + static_cast<size_t>(balance_[k]);
      auto part = slice(chain, begin, end);
      for (auto& p : part->parameters()) out[k % static_cast<size_t>(stages_)].push_back(p);
      if (mine && static_cast<int>(k) % stages_ == stage_) mine->push_back(part);
      begin = end;
    }
    for (auto& params : out) params = in_model_order(params, *model.module);
    return out;
  }
  // An optimizer of another kind than SGD, Adam, AdamW: replica 0's stages' bytes onto rank 0.
  const torch::optim::Optimizer* save_optimizer_bytes(torch::optim::Optimizer& opt,
                                                      TrainingState& state) {
    if (replica_ != 0) return nullptr;
    auto all =
        bytes_to_rank_zero(dist_, optimizer_bytes(opt), stages_ * degree_, kOptimizerTag, at::kCPU);
    for (size_t r = 0; r < all.size(); ++r) {
      const int s = mesh_.coordinate(static_cast<int>(r), "pp");
      const int t = mesh_.coordinate(static_cast<int>(r), "tp");
      state.tensors[optimizer_key(s, t, degree_)] = all[r];
    }
    return nullptr;  // the stages' states travel in `state`
  }
  // The module whose parameters this rank steps: the split build, or the whole model.
  torch::nn::Module& trained() { return *tp_.trained().module; }
  // The task's model: on every rank, whole, for checkpoints.
  torch::nn::Module& whole_module() { return *tp_.whole().module; }
  bool first() const { return stage_ == 0; }
  bool last() const { return stage_ == stages_ - 1; }

  // `params` (a stage's) in the order the model lists them.
  static std::vector<at::Tensor> in_model_order(const std::vector<at::Tensor>& params,
                                                const torch::nn::Module& model) {
    std::set<const void*> mine;
    for (const auto& p : params) mine.insert(p.unsafeGetTensorImpl());
    std::vector<at::Tensor> out;
    for (const auto& p : model.parameters()) {
      if (mine.count(p.unsafeGetTensorImpl())) out.push_back(p);
    }
    return out;
  }

  int stages_, degree_;
  DeviceMesh mesh_;
  int replica_, stage_, v_ = 1;
  std::vector<int64_t> balance_;  // blocks per pipeline stage
  at::Device dev_;
  bool bf16_ = false;  // the stage's forwards under bf16 autocast (Note [Grid under autocast])
  TpApplied tp_;       // the model this rank trains, split over "tp" where t > 1
  std::vector<std::vector<at::Tensor>> stage_params_;        // per stage, in the model's order
  std::vector<std::vector<at::Tensor>> whole_stage_params_;  // the same of the whole model
  torch::nn::Sequential stage_module_{nullptr};  // chunks_[0]: the stage (no interleaving)
  std::vector<torch::nn::Sequential> chunks_;    // this rank's stages, in the model's order
  std::unique_ptr<DistributedDataParallel> ddp_;
  std::unique_ptr<DistPipeline> pipe_;
  std::set<const void*> in_stage_;  // the parameters this rank steps, by their TensorImpl
  // The standard optimizer of the last save or load (Note [Standard optimizer state]).
  std::unique_ptr<torch::optim::Optimizer> whole_opt_;
};

}  // namespace

std::unique_ptr<TrainStrategy> make_grid_strategy(const TrainTask& task,
                                                  const TrainerOptions& options, const Dist& dist,
                                                  Model& model, const at::Tensor& sample) {
  return std::make_unique<GridStrategy>(task, options, dist, model, sample);
}

}  // namespace scaletrain
