// Activation checkpointing (activation_checkpoint.h, Note [Recompute in backward]): the GPT with
// each block recomputed in backward computes the same loss and the same gradients, bit for bit,
// as the GPT that keeps its activations — with dropout (the generators are replayed), under DDP
// and split over a tensor-parallel group (whose operators communicate again in the recompute).

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <map>

#include "scaletrain/activation_checkpoint.h"
#include "scaletrain/checkpoint.h"
#include "scaletrain/data.h"
#include "scaletrain/trainer.h"
#include "support/ranks.h"
#include "support/tolerance.h"
#include "zoo_models.h"

namespace scaletrain {
namespace {

namespace fs = std::filesystem;

Model gpt(bool checkpointed, double dropout, const Model* like = nullptr) {
  ModelOptions o;
  o.vocab_size = 16;
  o.context = 8;
  o.dropout = dropout;
  o.checkpoint_activations = checkpointed;
  Model m = make_model("gpt-tiny", o);
  if (like) {
    torch::NoGradGuard no_grad;
    auto from = like->module->named_parameters();
    for (auto& p : m.module->named_parameters()) p.value().copy_(from[p.key()]);
  }
  return m;
}

struct Step {
  at::Tensor loss;
  std::map<std::string, at::Tensor> grads;
  at::Tensor next_draw;  // the generator after the step
};

Step step(Model& m, const at::Tensor& x, const at::Tensor& y) {
  torch::manual_seed(11);
  auto out = m.forward(x);
  auto loss = at::cross_entropy_loss(out.reshape({-1, out.size(-1)}), y.reshape({-1}));
  loss.backward();
  Step s{loss.detach(), {}, at::rand({4})};
  for (const auto& p : m.module->named_parameters()) s.grads[p.key()] = p.value().grad().clone();
  return s;
}

TEST(ActivationCheckpoint, GptWithDropoutGivesTheSameLossAndGradientsBitForBit) {
  auto g = at::make_generator<at::CPUGeneratorImpl>(3);
  auto tokens = at::randint(0, 16, {4, 9}, g, at::kLong);
  auto x = tokens.narrow(1, 0, 8), y = tokens.narrow(1, 1, 8);
  Model plain = gpt(false, 0.2);
  Model recomputed = gpt(true, 0.2, &plain);
  const Step a = step(plain, x, y), b = step(recomputed, x, y);
  EXPECT_TRUE(at::equal(a.loss, b.loss));
  ASSERT_EQ(a.grads.size(), b.grads.size());
  for (const auto& [name, grad] : a.grads) EXPECT_TRUE(at::equal(grad, b.grads.at(name))) << name;
  EXPECT_TRUE(at::equal(a.next_draw, b.next_draw)) << "the generator goes on as without recompute";
  // With the generator not replayed, the recomputed dropout masks differ: the test can fail.
  Model other_masks = gpt(true, 0.2, &plain);
  torch::manual_seed(11);
  auto out = other_masks.forward(x);
  torch::manual_seed(12);  // the backward's recompute now starts from another state...
  at::cross_entropy_loss(out.reshape({-1, 16}), y.reshape({-1})).backward();
  // ...but the replay puts the saved state back, so the gradients are still a's.
  for (const auto& p : other_masks.module->named_parameters()) {
    EXPECT_TRUE(at::equal(p.value().grad(), a.grads.at(p.key()))) << p.key();
  }
}

TEST(ActivationCheckpoint, WithoutGradientsItIsThePlainFunction) {
  int calls = 0;
  auto fn = [&calls](const at::Tensor& t) {
    ++calls;
    return t * 2;
  };
  auto x = at::ones({3});
  EXPECT_TRUE(at::equal(activation_checkpoint(fn, x), x * 2));  // input needs no gradient
  {
    torch::NoGradGuard no_grad;
    auto w = at::ones({3}).requires_grad_();
    EXPECT_FALSE(activation_checkpoint(fn, w).requires_grad());
  }
  EXPECT_EQ(calls, 2);
  auto w = at::ones({3}).requires_grad_();
  activation_checkpoint(fn, w).sum().backward();  // once forward, once in backward
  EXPECT_EQ(calls, 4);
  EXPECT_TRUE(at::equal(w.grad(), at::full({3}, 2.0f)));
}

// Through the trainer, with and without checkpointed blocks: the same final weights, bit for
// bit. One rank with dropout (ranks that are threads share the CPU generator, so dropout is
// reproducible with one only), DDP over 2 ranks, and tp 2.
std::map<std::string, at::Tensor> trained(bool checkpointed, double dropout, int world, int tp) {
  auto g = at::make_generator<at::CPUGeneratorImpl>(7);
  auto tokens = at::randint(0, 16, {32, 9}, g, at::kLong);
  Dataset train_set{tokens.narrow(1, 0, 8).contiguous(), tokens.narrow(1, 1, 8).contiguous(), 16};
  torch::manual_seed(1);
  const Model start = gpt(false, dropout);
  const fs::path out = fs::temp_directory_path() /
                       ("scaletrain_recompute_" + std::to_string(getpid()) + "_" +
                        std::to_string(checkpointed) + std::to_string(world) + std::to_string(tp));
  fs::remove_all(out);
  TrainResult r;
  auto errors = testing::run_ranks(world, [&](Dist& d) {
    TrainTask task;
    task.train_data = in_memory(train_set);
    task.model = [&] { return gpt(checkpointed, dropout, &start); };
    TrainerOptions o;
    o.epochs = 2;
    o.batch_size = 8;
    o.progress = o.tensorboard = false;
    o.device = at::kCPU;
    o.out_dir = out.string();
    o.tensor_parallel.size = tp;
    auto mine = train(task, o, d);
    if (d.rank() == 0) r = mine;
  });
  EXPECT_EQ(errors, std::vector<std::string>(static_cast<size_t>(world)));
  Model m = gpt(false, 0);
  load_weights(r.weights_path, *m.module);
  std::map<std::string, at::Tensor> w;
  for (const auto& p : m.module->named_parameters()) w[p.key()] = p.value().detach().clone();
  fs::remove_all(out);
  return w;
}

TEST(ActivationCheckpoint, TheTrainerUnderDdpAndTensorParallelTrainsTheSameWeights) {
  struct Case {
    int world, tp;
    double dropout;
  };
  for (const Case c : {Case{1, 1, 0.1}, Case{2, 1, 0.0}, Case{2, 2, 0.0}}) {
    const auto a = trained(false, c.dropout, c.world, c.tp);
    const auto b = trained(true, c.dropout, c.world, c.tp);
    const std::string where = "world " + std::to_string(c.world) + ", tp " + std::to_string(c.tp);
    for (const auto& [name, v] : a) {
      EXPECT_TRUE(testing::bit_for_bit(b.at(name), v)) << where << ": " << name;
    }
  }
}

}  // namespace
}  // namespace scaletrain
