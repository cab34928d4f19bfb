// The trainer's tensor parallelism with a model of its own: a residual MLP block written with
// ParallelLinear where torch::nn::Linear would be, split by a plan (the up projection colwise,
// the down projection rowwise) over every rank, or over groups of `tp` ranks with data
// parallelism across them. model.pt holds the whole model, which loads into the unsplit module.
//   scaletrain run --nproc-per-node 2 -- ./tensor_parallel_example runs/tp 2
#include <scaletrain/checkpoint.h>
#include <scaletrain/data.h>
#include <scaletrain/error.h>
#include <scaletrain/tensor_parallel.h>
#include <scaletrain/trainer.h>
#include <torch/torch.h>

#include <cstdlib>
#include <iostream>

// Points of two interleaved spirals.
scaletrain::Dataset spirals(int64_t n, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  auto y = torch::randint(2, {n}, gen, torch::kLong);
  auto t = torch::rand({n}, gen) * 3 * M_PI;
  auto turn = t + M_PI * y.to(torch::kFloat);
  auto x = torch::stack({t * torch::cos(turn), t * torch::sin(turn)}, 1) / 10 +
           0.03 * torch::randn({n, 2}, gen);
  return {x, y, 2};
}

struct NetImpl : torch::nn::Module {
  torch::nn::Linear embed{register_module("embed", torch::nn::Linear(2, 64))};
  torch::nn::LayerNorm norm{
      register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({64})))};
  scaletrain::ParallelLinear up{register_module("up", scaletrain::ParallelLinear(64, 256))};
  scaletrain::ParallelLinear down{register_module("down", scaletrain::ParallelLinear(256, 64))};
  torch::nn::Linear head{register_module("head", torch::nn::Linear(64, 2))};
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = torch::relu(embed(x));
    h = h + down(torch::gelu(up(norm(h))));  // each rank: a quarter of the 256 hidden units
    return head(h);
  }
};

double accuracy(NetImpl& net, const scaletrain::Dataset& d) {
  torch::NoGradGuard no_grad;
  return net.forward(d.inputs).argmax(1).eq(d.targets).to(torch::kDouble).mean().item<double>();
}

int run(int argc, char** argv) {
  const std::string out = argc > 1 ? argv[1] : "runs/tensor_parallel_example";
  auto dist = scaletrain::init_process_group();
  scaletrain::TrainerOptions o;
  o.tensor_parallel.size = dist.size();
  if (argc > 2) {
    char* end = nullptr;
    o.tensor_parallel.size = static_cast<int>(std::strtol(argv[2], &end, 10));
    if (*end != '\0' || o.tensor_parallel.size < 1) {
      throw scaletrain::UsageError(std::string("tensor-parallel degree '") + argv[2] +
                                   "': give a positive number of ranks");
    }
  }
  const auto train_set = spirals(4096, 1), test_set = spirals(1024, 2);
  scaletrain::TrainTask task;
  task.model = [] {
    auto net = std::make_shared<NetImpl>();
    scaletrain::Model m = scaletrain::model_of(net, "spiral-mlp");
    m.parallelize = [net](const scaletrain::Dist& tp, bool) {
      scaletrain::TensorParallelPlan plan;
      plan["up"] = scaletrain::colwise();
      plan["down"] = scaletrain::rowwise();  // its output summed over the group: whole again
      scaletrain::parallelize_module(*net, tp, plan);
    };
    return m;
  };
  task.train_data = scaletrain::in_memory(train_set);
  task.test_data = scaletrain::in_memory(test_set);
  task.optimizer = [](const std::vector<torch::Tensor>& p) {
    return std::make_unique<torch::optim::Adam>(p, torch::optim::AdamOptions(0.01));
  };
  o.epochs = 15;
  o.batch_size = 128;
  o.max_grad_norm = 1.0;
  o.out_dir = out;
  o.progress = false;
  o.device = at::kCPU;
  auto result = scaletrain::train(task, o, dist);
  if (dist.rank() != 0) return 0;
  NetImpl whole;  // model.pt: the whole model under the module's own names
  scaletrain::load_weights(result.weights_path, whole);
  const double reloaded = accuracy(whole, test_set);
  std::cout << "tp " << o.tensor_parallel.size << " of " << dist.size() << " ranks: test accuracy "
            << result.test_accuracy << " after " << result.global_step
            << " steps; model.pt, unsplit: " << reloaded << "\n";
  return result.test_accuracy > 0.9 && reloaded > 0.9 ? 0 : 1;
}

// A misuse (a degree that does not divide the world...) is a UsageError: exit 2, one line.
int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const scaletrain::UsageError& e) {
    std::cerr << argv[0] << ": " << e.what() << "\n";
    return 2;
  } catch (const std::exception& e) {
    std::cerr << argv[0] << ": error: " << e.what() << "\n";
    return 1;
  }
}
