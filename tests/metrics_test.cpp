// Token-level metrics (trainer.h: accuracy(), token_loss(), perplexity()): a sequence's targets
// equal to the ignore index are left out, and the trainer's mean is one over tokens, not over
// sequences (a sample of 2 counted tokens weighs a quarter of one with 8), exact over ranks and
// the sampler's padded duplicates.

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/embedding.h>
#include <torch/optim/sgd.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>

#include "scaletrain/data.h"
#include "scaletrain/error.h"
#include "scaletrain/trainer.h"
#include "support/ranks.h"

namespace scaletrain {
namespace {

namespace fs = std::filesystem;

constexpr int64_t kVocab = 5, kPositions = 8;

// Targets with a different number of ignored positions per sample (0 to 6 of 8).
at::Tensor targets_with_holes(int64_t samples, at::Generator& g) {
  auto y = at::randint(kVocab, {samples, kPositions}, g, at::kLong);
  for (int64_t i = 0; i < samples; ++i) {
    for (int64_t p = 0; p < (i * 3) % 7; ++p) y[i][p] = -100;
  }
  return y;
}

// The exact token means, by hand (float64): every counted target once. The float32 log-softmax
// behind token_loss() rounds each of its terms: an absolute error of at most (vocabulary + 4)
// units of float32 times the largest |logit| + log(vocabulary) + 1 per token, and so for their
// mean.
double loss_bound(const at::Tensor& logits) {
  return (kVocab + 4) * std::ldexp(1.0, -24) *
         (logits.abs().max().item<double>() + std::log(double(kVocab)) + 1);
}

struct Expected {
  double loss = 0, accuracy = 0;
};
Expected by_hand(const at::Tensor& logits, const at::Tensor& y) {
  auto logp = at::log_softmax(logits.to(at::kDouble), -1);
  double loss = 0, right = 0, n = 0;
  for (int64_t i = 0; i < y.size(0); ++i) {
    for (int64_t p = 0; p < y.size(1); ++p) {
      const int64_t t = y[i][p].item<int64_t>();
      if (t == -100) continue;
      loss -= logp[i][p][t].item<double>();
      right += logits[i][p].argmax().item<int64_t>() == t ? 1 : 0;
      n += 1;
    }
  }
  return {loss / n, right / n};
}

TEST(TokenMetrics, MeansAreOverTokensWithIgnoredTargetsLeftOut) {
  auto g = at::make_generator<at::CPUGeneratorImpl>(5);
  auto logits = at::randn({6, kPositions, kVocab}, g);
  auto y = targets_with_holes(6, g);
  const Expected want = by_hand(logits, y);
  // The trainer's weighted mean, here on one batch.
  auto mean = [&](const Metric& m) {
    auto w = m.weight(logits, y);
    double v = (m.per_sample(logits, y) * w).sum().item<double>() / w.sum().item<double>();
    return m.finish ? m.finish(v) : v;
  };
  const double bound = loss_bound(logits);
  EXPECT_NEAR(mean(token_loss()), want.loss, bound);
  EXPECT_NEAR(mean(perplexity()), std::exp(want.loss), 2 * bound * std::exp(want.loss));
  EXPECT_NEAR(mean(accuracy()), want.accuracy, 1e-12);
  // The unweighted mean of the samples' own means is another number here: the test can fail.
  EXPECT_GT(std::abs(token_loss().per_sample(logits, y).mean().item<double>() - want.loss), 1e-3);
}

// A model whose logits are a lookup of the input token, trained with lr 0: the trainer's
// test_loss, test_perplexity and test_accuracy on 2 ranks (7 test samples: one padded
// duplicate) equal the token means by hand.
// A class-split output (tensor parallelism's vocabulary over 2 and 4 ranks) scores as the whole
// one: accuracy() the same argmax, the lowest class among equal largest ones on different ranks
// included, and token_loss() the same cross entropy (float64: a per-token rounding of the log of
// a sum of 8 exponentials), for targets on every rank's slice and ignored ones.
TEST(TokenMetrics, ASplitOutputScoresAsTheWholeOne) {
  constexpr int64_t vocab = 8;
  auto g = at::make_generator<at::CPUGeneratorImpl>(11);
  auto logits = at::randn({6, kPositions, vocab}, g, at::kDouble);
  logits[0][0][1] = 9;  // ties across the slices: class 1 (rank 0) wins at tp 2 and 4
  logits[0][0][6] = 9;
  logits[1][2][3] = 7;  // class 3 (rank 0 at tp 2, rank 1 at tp 4) against class 5
  logits[1][2][5] = 7;
  auto y = at::randint(vocab, {6, kPositions}, g, at::kLong);
  y[2][3] = -100;
  y[3][0] = -100;
  y[0][0] = 1;
  y[1][2] = 5;  // the tie's loser: a wrong answer either way
  const auto acc = accuracy(), loss = token_loss();
  const auto whole_acc = acc.per_sample(logits, y), whole_loss = loss.per_sample(logits, y);
  EXPECT_EQ(logits.argmax(-1)[0][0].item<int64_t>(), 1) << "argmax picks the first of equals";
  for (int tp : {2, 4}) {
    std::vector<at::Tensor> accs(tp), losses(tp);
    auto errors = testing::run_ranks(tp, [&](Dist& d) {
      const int64_t width = vocab / tp, offset = d.rank() * width;
      const ClassSlice where{&d, offset};
      const auto slice = logits.narrow(-1, offset, width);
      accs[d.rank()] = acc.per_sample_split(slice, y, where);
      losses[d.rank()] = loss.per_sample_split(slice, y, where);
    });
    ASSERT_EQ(errors, std::vector<std::string>(tp));
    for (int r = 0; r < tp; ++r) {
      EXPECT_TRUE(at::equal(accs[r], whole_acc)) << "tp " << tp << ", rank " << r;
      EXPECT_TRUE(at::allclose(losses[r], whole_loss, 0, 16 * std::ldexp(1.0, -52) * 20))
          << "tp " << tp << ", rank " << r << ": " << (losses[r] - whole_loss).abs().max();
    }
  }
}

// Regression (SplitPathScoredOutOfVocabularyTargetsSilently): a target outside the classes was
// scored on the class-split path (tensor-parallel evaluation: never a hit, a loss from a clamped
// id) while the whole path's loss threw LibTorch's error and its accuracy counted a miss. Both
// paths' metrics now refuse it, naming the target and its sample; the ignore index stays fine.
TEST(TokenMetrics, ATargetOutsideTheClassesIsAnErrorOnBothPaths) {
  constexpr int64_t vocab = 8;
  auto g = at::make_generator<at::CPUGeneratorImpl>(5);
  const auto logits = at::randn({3, kPositions, vocab}, g, at::kDouble);
  for (const int64_t wrong : {vocab, int64_t{-1}}) {
    auto y = at::randint(vocab, {3, kPositions}, g, at::kLong);
    y[0][1] = -100;  // ignored: no error
    y[1][2] = wrong;
    const std::string want = "target " + std::to_string(wrong) +
                             " of the batch's sample 1 is outside the output's 8 classes (0 to 7";
    for (const auto& m : {accuracy(), token_loss()}) {
      try {
        m.per_sample(logits, y);
        ADD_FAILURE() << m.name << " took target " << wrong;
      } catch (const UsageError& e) {
        EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
      }
      auto errors = testing::run_ranks(2, [&](Dist& d) {
        const int64_t width = vocab / 2;
        m.per_sample_split(logits.narrow(-1, d.rank() * width, width), y,
                           ClassSlice{&d, d.rank() * width});
      });
      for (const auto& e : errors)
        EXPECT_NE(e.find(want), std::string::npos) << m.name << ": " << e;
    }
    y[1][2] = -100;
    EXPECT_NO_THROW(accuracy().per_sample(logits, y));
  }
}

TEST(TokenMetrics, TheTrainerReportsTokenMeansOverRanks) {
  auto g = at::make_generator<at::CPUGeneratorImpl>(9);
  Dataset train_set{at::randint(kVocab, {8, kPositions}, g, at::kLong),
                    at::randint(kVocab, {8, kPositions}, g, at::kLong), kVocab};
  Dataset test_set{at::randint(kVocab, {7, kPositions}, g, at::kLong), targets_with_holes(7, g),
                   kVocab};
  auto table = at::randn({kVocab, kVocab}, g);
  const auto logits = at::embedding(table, test_set.inputs);
  const Expected want = by_hand(logits, test_set.targets);
  const double bound = loss_bound(logits);
  const fs::path out =
      fs::temp_directory_path() / ("scaletrain_token_metrics_" + std::to_string(getpid()));
  fs::remove_all(out);
  std::map<std::string, double> got;
  auto errors = testing::run_ranks(2, [&](Dist& d) {
    TrainTask task;
    task.train_data = in_memory(train_set);
    task.test_data = in_memory(test_set);
    task.model = [&table] {
      auto e = torch::nn::Embedding(kVocab, kVocab);
      torch::NoGradGuard no_grad;
      e->weight.copy_(table);
      return model_of(e.ptr(), "lookup");
    };
    task.optimizer =
        [](const std::vector<at::Tensor>& p) -> std::unique_ptr<torch::optim::Optimizer> {
      return std::make_unique<torch::optim::SGD>(p, torch::optim::SGDOptions(0.0));
    };
    task.metrics = {accuracy(), token_loss(), perplexity()};
    TrainerOptions o;
    o.epochs = 1;
    o.batch_size = 4;
    o.progress = o.tensorboard = o.channels_last = false;
    o.device = at::kCPU;
    o.out_dir = out.string();
    auto r = train(task, o, d);
    if (d.rank() == 0) got = r.metrics;
  });
  ASSERT_EQ(errors, std::vector<std::string>(2));
  EXPECT_NEAR(got.at("test_loss"), want.loss, bound);
  EXPECT_NEAR(got.at("test_perplexity"), std::exp(want.loss), 2 * bound * std::exp(want.loss));
  EXPECT_NEAR(got.at("test_accuracy"), want.accuracy, 1e-12);
  fs::remove_all(out);
}

// The trainer's side of the same regression: a replica whose test data holds such a target
// refuses it after the batches' sums, and so does every other rank at once, instead of leaving
// them to wait for it in the sum until the timeout.
TEST(TokenMetrics, ATargetOutsideTheClassesStopsEveryReplicaAtTheEvaluation) {
  auto g = at::make_generator<at::CPUGeneratorImpl>(4);
  Dataset train_set{at::randint(kVocab, {8, kPositions}, g, at::kLong),
                    at::randint(kVocab, {8, kPositions}, g, at::kLong), kVocab};
  auto targets = at::randint(kVocab, {8, kPositions}, g, at::kLong);
  targets[1][3] = kVocab + 2;  // sample 1: replica 1's (the test set is not shuffled)
  Dataset test_set{at::randint(kVocab, {8, kPositions}, g, at::kLong), targets, kVocab};
  const fs::path out =
      fs::temp_directory_path() / ("scaletrain_bad_target_" + std::to_string(getpid()));
  fs::remove_all(out);
  auto errors = testing::run_ranks(2, [&](Dist& d) {
    TrainTask task;
    task.train_data = in_memory(train_set);
    task.test_data = in_memory(test_set);
    task.model = [] { return model_of(torch::nn::Embedding(kVocab, kVocab).ptr(), "lookup"); };
    task.metrics = {accuracy(), token_loss()};
    TrainerOptions o;
    o.epochs = 1;
    o.batch_size = 4;
    o.progress = o.tensorboard = o.channels_last = false;
    o.device = at::kCPU;
    o.timeout_s = 30;  // were replica 0 left waiting, its error would be this timeout's
    o.out_dir = out.string();
    train(task, o, d);
  });
  ASSERT_EQ(errors.size(), 2u);
  EXPECT_NE(errors[1].find(
                "accuracy(): target 7 of the batch's sample 0 is outside the output's 5 classes"),
            std::string::npos)
      << errors[1];
  EXPECT_NE(errors[0].find("rank 0: another rank's test data was refused by a metric"),
            std::string::npos)
      << errors[0];
  fs::remove_all(out);
}

}  // namespace
}  // namespace scaletrain
