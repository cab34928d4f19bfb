// DataParallel of a module of its own (seeds 001, 003): one replica per device, the batch
// scattered, gradients summed onto the module itself.   ./data_parallel_example cpu,cpu
#include <scaletrain/data_parallel.h>
#include <scaletrain/error.h>
#include <torch/torch.h>

#include <iostream>
#include <sstream>

// Not a torch::nn::Cloneable: DataParallel builds the other replicas with a factory.
struct Net : torch::nn::Module {
  torch::nn::Linear fc1{register_module("fc1", torch::nn::Linear(32, 128))};
  torch::nn::Linear fc2{register_module("fc2", torch::nn::Linear(128, 5))};
  torch::Tensor forward(const torch::Tensor& x) { return fc2(torch::relu(fc1(x))); }
};

int run(int argc, char** argv) {
  std::vector<at::Device> devices;
  std::stringstream list(argc > 1 ? argv[1] : "cpu,cpu");
  for (std::string d; std::getline(list, d, ',');) devices.emplace_back(d);
  torch::manual_seed(0);
  auto x = torch::randn({256, 32});
  auto y = x.matmul(torch::randn({32, 5})).argmax(1);
  auto net = std::make_shared<Net>();
  scaletrain::DataParallel dp(
      net, std::function<std::shared_ptr<Net>()>([] { return std::make_shared<Net>(); }), devices);
  auto ce = [](const torch::Tensor& out, const torch::Tensor& t) {
    return torch::nn::functional::cross_entropy(out, t);
  };
  // The replicas' summed gradients are the module's own on the whole batch.
  auto single = std::make_shared<Net>();
  {
    torch::NoGradGuard g;
    for (size_t i = 0; i < net->parameters().size(); ++i)
      single->parameters()[i].copy_(net->parameters()[i].cpu());
  }
  dp.train_step(x.to(devices[0]), y.to(devices[0]), ce);
  ce(single->forward(x), y).backward();
  double worst = 0, scale = 0;
  for (size_t i = 0; i < single->parameters().size(); ++i) {
    auto want = single->parameters()[i].grad();
    worst = std::max(worst, (net->parameters()[i].grad().cpu() - want).abs().max().item<double>());
    scale = std::max(scale, want.abs().max().item<double>());
  }
  std::cout << devices.size()
            << " replicas; largest gradient difference from one module: " << worst / scale
            << " of the largest\n";
  if (worst > 1e-4 * scale) return 1;
  torch::optim::SGD opt(dp.parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  double first = 0, last = 0;
  for (int step = 0; step < 30; ++step) {
    opt.zero_grad();
    last = dp.train_step(x.to(devices[0]), y.to(devices[0]), ce).item<double>();
    if (step == 0) first = last;
    opt.step();
  }
  std::cout << "loss " << first << " -> " << last << "\n";
  return last < first ? 0 : 1;
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
