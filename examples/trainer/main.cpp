// The trainer with a model and a data set of its own: a LibTorch data set, a module with its
// chain of blocks (so that the pipeline strategies can split it), Adam and a step schedule.
//   scaletrain run --nproc-per-node 2 -- ./trainer_example runs/x ddp
//   ./trainer_example runs/y pipeline           (one process, the blocks over cpu,cpu)
#include <scaletrain/blocks.h>
#include <scaletrain/error.h>
#include <scaletrain/trainer.h>
#include <torch/torch.h>

#include <iostream>

// Points of two interleaved spirals, written as LibTorch's data sets are.
class Spirals : public torch::data::datasets::Dataset<Spirals> {
 public:
  Spirals(int64_t n, uint64_t seed) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
    y_ = torch::randint(2, {n}, gen, torch::kLong);
    auto t = torch::rand({n}, gen) * 3 * M_PI;
    auto turn = t + M_PI * y_.to(torch::kFloat);
    x_ = torch::stack({t * torch::cos(turn), t * torch::sin(turn)}, 1) / 10 +
         0.03 * torch::randn({n, 2}, gen);
  }
  torch::data::Example<> get(size_t i) override { return {x_[i], y_[i]}; }
  torch::optional<size_t> size() const override { return x_.size(0); }

 private:
  torch::Tensor x_, y_;
};

struct NetImpl : torch::nn::Module {
  torch::nn::Linear fc1{register_module("fc1", torch::nn::Linear(2, 64))};
  torch::nn::Linear fc2{register_module("fc2", torch::nn::Linear(64, 64))};
  torch::nn::Linear fc3{register_module("fc3", torch::nn::Linear(64, 2))};
  torch::Tensor forward(const torch::Tensor& x) {
    return fc3(torch::relu(fc2(torch::relu(fc1(x)))));
  }
};

int run(int argc, char** argv) {
  const std::string out = argc > 1 ? argv[1] : "runs/trainer_example";
  const std::string strategy = argc > 2 ? argv[2] : "ddp";
  scaletrain::TrainerOptions o;
  o.strategy = scaletrain::parse_strategy(strategy);  // a UsageError names the strategies
  auto dist = scaletrain::init_process_group();
  scaletrain::TrainTask task;
  task.model = [] {
    auto net = std::make_shared<NetImpl>();
    auto block = [](std::shared_ptr<torch::nn::Module> part,
                    std::function<torch::Tensor(const torch::Tensor&)> f) {
      return scaletrain::Block(scaletrain::BlockParts{{"fc", part}}, std::move(f));
    };
    return scaletrain::model_of(net, "spirals", [net, block] {
      return torch::nn::Sequential(
          {{"fc1", block(net->fc1.ptr(),
                         [net](const torch::Tensor& x) { return torch::relu(net->fc1(x)); })},
           {"fc2", block(net->fc2.ptr(),
                         [net](const torch::Tensor& x) { return torch::relu(net->fc2(x)); })},
           {"fc3", block(net->fc3.ptr(), [net](const torch::Tensor& x) { return net->fc3(x); })}});
    });
  };
  task.train_data = scaletrain::torch_dataset(std::make_shared<Spirals>(4096, 1));
  task.test_data = scaletrain::torch_dataset(std::make_shared<Spirals>(1024, 2));
  task.optimizer = [](const std::vector<torch::Tensor>& p) {
    return std::make_unique<torch::optim::Adam>(p, torch::optim::AdamOptions(0.01));
  };
  task.scheduler = [](torch::optim::Optimizer& opt) {
    return std::make_unique<torch::optim::StepLR>(opt, 10, 0.3);
  };
  if (strategy == "dp" || strategy == "pipeline") o.devices = {at::kCPU, at::kCPU};
  o.epochs = 20;
  o.batch_size = 128;
  o.out_dir = out;
  o.progress = false;
  o.device = at::kCPU;
  auto result = scaletrain::train(task, o, dist);
  if (dist.rank() == 0) {
    std::cout << strategy << ": test accuracy " << result.test_accuracy << " after "
              << result.global_step << " steps\n";
  }
  return result.test_accuracy > 0.9 ? 0 : 1;
}

// The pattern for a program of scaletrain: a misuse (bad input, options that do not go
// together) is a UsageError whose message says what to change: exit 2. Anything else is a
// failure of the job: exit 1. Never let either reach std::terminate.
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
