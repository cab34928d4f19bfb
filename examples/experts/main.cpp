// The trainer's expert parallelism with a model of its own: a residual block whose MLP is a
// mixture of experts (scaletrain::MoE where an MLP would be: 8 experts, each token to its top 2),
// the experts spread over groups of `ep` ranks (each rank 8 / ep of them, the tokens sent to
// their experts by all-to-all), the rest data parallel. model.pt holds every expert by its
// global index, and loads into the model as built, on one process.
//   scaletrain run --nproc-per-node 2 -- ./experts_example runs/ep 2
#include <scaletrain/checkpoint.h>
#include <scaletrain/data.h>
#include <scaletrain/error.h>
#include <scaletrain/expert_parallel.h>
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
  scaletrain::MoE moe{register_module("moe", scaletrain::MoE(scaletrain::MoEOptions(64, 128, 8)))};
  torch::nn::Linear head{register_module("head", torch::nn::Linear(64, 2))};
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = torch::relu(embed(x));
    h = h + moe(norm(h));  // each point to 2 of the 8 experts, wherever they are
    return head(h);
  }
};

double accuracy(NetImpl& net, const scaletrain::Dataset& d) {
  torch::NoGradGuard no_grad;
  net.eval();
  return net.forward(d.inputs).argmax(1).eq(d.targets).to(torch::kDouble).mean().item<double>();
}

int run(int argc, char** argv) {
  const std::string out = argc > 1 ? argv[1] : "runs/experts_example";
  auto dist = scaletrain::init_process_group();
  scaletrain::TrainerOptions o;
  o.expert_parallel.size = dist.size();
  if (argc > 2) {
    char* end = nullptr;
    o.expert_parallel.size = static_cast<int>(std::strtol(argv[2], &end, 10));
    if (*end != '\0' || o.expert_parallel.size < 1) {
      throw scaletrain::UsageError(std::string("expert-parallel degree '") + argv[2] +
                                   "': give a positive number of ranks");
    }
  }
  const auto train_set = spirals(4096, 1), test_set = spirals(1024, 2);
  scaletrain::TrainTask task;
  // The trainer finds the MoE layers itself (scaletrain::moe_layers): nothing to declare.
  task.model = [] { return scaletrain::model_of(std::make_shared<NetImpl>(), "spiral-moe"); };
  task.train_data = scaletrain::in_memory(train_set);
  task.test_data = scaletrain::in_memory(test_set);
  task.optimizer = [](const std::vector<torch::Tensor>& p) {
    return std::make_unique<torch::optim::Adam>(p, torch::optim::AdamOptions(0.01));
  };
  o.epochs = 8;
  o.batch_size = 128;
  o.out_dir = out;
  o.progress = false;
  o.device = at::kCPU;
  auto result = scaletrain::train(task, o, dist);
  if (dist.rank() != 0) return 0;
  NetImpl whole;  // model.pt: every expert, under the module's own names
  scaletrain::load_weights(result.weights_path, whole);
  const double reloaded = accuracy(whole, test_set);
  std::cout << "ep " << o.expert_parallel.size << " of " << dist.size() << " ranks: test accuracy "
            << result.test_accuracy << " after " << result.global_step
            << " steps; model.pt, every expert on one process: " << reloaded << "\n";
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
