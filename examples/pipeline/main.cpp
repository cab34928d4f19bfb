// Seed 000's pipelined model parallel with a model of its own: its layers as a chain of blocks
// over two devices, each batch cut into micro-batches of split_size rows that flow through the
// stages at once.   ./pipeline_example cpu,cpu 8      (cuda:0,cuda:1 with two GPUs)
#include <scaletrain/blocks.h>
#include <scaletrain/error.h>
#include <scaletrain/pipeline.h>
#include <torch/torch.h>

#include <iostream>
#include <sstream>

struct NetImpl : torch::nn::Module {
  torch::nn::Conv2d conv1{
      register_module("conv1", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 16, 3)))};
  torch::nn::Conv2d conv2{
      register_module("conv2", torch::nn::Conv2d(torch::nn::Conv2dOptions(16, 32, 3)))};
  torch::nn::Linear fc{register_module("fc", torch::nn::Linear(32 * 12 * 12, 10))};
  torch::Tensor features(const torch::Tensor& x) {
    return torch::relu(conv2(torch::relu(conv1(x))));
  }
  torch::Tensor forward(const torch::Tensor& x) { return fc(features(x).flatten(1)); }
};

int run(int argc, char** argv) {
  std::vector<at::Device> devices;
  std::stringstream list(argc > 1 ? argv[1] : "cpu,cpu");
  for (std::string d; std::getline(list, d, ',');) devices.emplace_back(d);
  const int64_t split_size = argc > 2 ? std::stoll(argv[2]) : 8;
  torch::manual_seed(0);
  auto net = std::make_shared<NetImpl>(), whole = std::make_shared<NetImpl>();
  {  // the same weights on one device, to compare with
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < net->parameters().size(); ++i)
      whole->parameters()[i].copy_(net->parameters()[i]);
  }
  // The model as two blocks sharing its layers: the form a pipeline splits.
  torch::nn::Sequential chain(
      {{"features", scaletrain::Block(scaletrain::BlockParts{{"conv1", net->conv1.ptr()},
                                                             {"conv2", net->conv2.ptr()}},
                                      [net](const torch::Tensor& x) { return net->features(x); })},
       {"head",
        scaletrain::Block(scaletrain::BlockParts{{"fc", net->fc.ptr()}},
                          [net](const torch::Tensor& x) { return net->fc(x.flatten(1)); })}});
  auto x = torch::randn({64, 1, 16, 16});
  auto y = torch::randint(10, {64});
  scaletrain::check_chain(
      *net, chain, [&](const torch::Tensor& t) { return net->forward(t); }, x);
  scaletrain::PipelineOptions o;
  o.balance = {1, 1};  // one block per stage
  o.devices = devices;
  o.split_size = split_size;
  o.schedule = scaletrain::PipelineSchedule::k1F1B;
  scaletrain::Pipeline pipe(chain, o);
  for (size_t s = 0; s < pipe.stages().size(); ++s) {
    int64_t n = 0;
    for (const auto& p : pipe.stages()[s]->parameters()) n += p.numel();
    std::cout << "stage " << s << " on " << devices[s] << ": " << n << " parameters\n";
  }
  auto ce = [](const torch::Tensor& out, const torch::Tensor& t) {
    return torch::nn::functional::cross_entropy(out, t);
  };
  // One step's gradients against the whole model on one device: micro-batches only change the
  // order of the sums.
  pipe.train_step(x, y, ce);
  ce(whole->forward(x), y).backward();
  double worst = 0, scale = 0;
  auto got = chain->parameters(), want = whole->parameters();
  for (size_t i = 0; i < got.size(); ++i) {
    worst = std::max(worst, (got[i].grad().cpu() - want[i].grad()).abs().max().item<double>());
    scale = std::max(scale, want[i].grad().abs().max().item<double>());
  }
  std::cout << "largest gradient difference from one device: " << worst / scale
            << " of the largest\n";
  if (worst > 1e-4 * scale) return 1;
  torch::optim::SGD opt(chain->parameters(), 0.05);
  for (int step = 0; step < 20; ++step) {
    opt.zero_grad();
    auto loss = pipe.train_step(x, y, ce);
    opt.step();
    if (step % 5 == 0 || step == 19)
      std::cout << "step " << step << " loss " << loss.item<double>() << "\n";
  }
  return 0;
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
