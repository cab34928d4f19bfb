// Its own model with DistributedDataParallel, DistributedSampler, a checkpoint every epoch and an
// exact resume, under any launcher: scaletrain run, torchrun --no-python, srun, mpirun.
//   scaletrain run --nproc-per-node 2 -- ./ddp_example runs/x   (docs/library.md walks through it)
#include <scaletrain/checkpoint.h>
#include <scaletrain/ddp.h>
#include <scaletrain/error.h>
#include <scaletrain/sampler.h>
#include <torch/torch.h>

#include <iostream>

struct NetImpl : torch::nn::Module {
  torch::nn::Linear fc1{register_module("fc1", torch::nn::Linear(20, 64))};
  torch::nn::Linear fc2{register_module("fc2", torch::nn::Linear(64, 4))};
  torch::Tensor forward(const torch::Tensor& x) { return fc2(torch::relu(fc1(x))); }
};
TORCH_MODULE(Net);

int run(int argc, char** argv) {
  const std::string out = argc > 1 ? argv[1] : "runs/ddp_example";
  const int64_t stop_at = argc > 2 ? std::stoll(argv[2]) : -1;  // to try the resume: stop there
  auto dist = scaletrain::init_process_group();  // the launcher's RANK, WORLD_SIZE, MASTER_*...
  torch::manual_seed(0);                         // the same data and initial weights on every rank
  auto x = torch::randn({2048, 20});
  auto y = x.matmul(torch::randn({20, 4})).argmax(1);  // a teacher's labels
  Net net;
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  scaletrain::SamplerOptions so;
  so.dataset_size = x.size(0);
  so.num_replicas = dist.size();
  so.rank = dist.rank();
  scaletrain::DistributedSampler sampler(so);
  scaletrain::TrainingState state;
  state.run_id = "ddp-example";
  state.model_name = "net";
  if (auto last = scaletrain::newest_valid_checkpoint(out)) {
    state = scaletrain::load_checkpoint(*last, *net, opt, "net");
    sampler.load_state(state.sampler);
  }
  scaletrain::DistributedDataParallel ddp(net, dist);
  const int64_t batch = 64 / dist.size();  // a global batch of 64
  for (int64_t epoch = state.epoch; epoch < 4; ++epoch) {
    if (epoch != sampler.epoch()) sampler.set_epoch(epoch);  // a new shuffle each epoch
    auto idx = torch::tensor(sampler.remaining());
    torch::Tensor loss;
    for (int64_t i = 0; i < idx.size(0); i += batch) {
      auto rows = idx.narrow(0, i, std::min(batch, idx.size(0) - i));
      opt.zero_grad();
      loss = torch::nn::functional::cross_entropy(ddp(x.index_select(0, rows)),
                                                  y.index_select(0, rows));
      loss.backward();  // gradients averaged over the ranks, overlapping backward
      opt.step();
      sampler.advance(rows.size(0));
      if (++state.global_step == stop_at) return 3;  // "interrupted": the next run resumes
    }
    sampler.set_epoch(epoch + 1);
    state.epoch = epoch + 1;
    state.sampler = sampler.state();
    if (dist.rank() == 0) scaletrain::save_checkpoint(out, state, *net, opt, /*keep=*/2);
    dist.barrier();  // the checkpoint is on disk before any rank goes on
    if (dist.rank() == 0)
      std::cout << "epoch " << epoch + 1 << " loss " << loss.item<double>() << "\n";
  }
  ddp.join();
  ddp.check_replicas();  // throws unless every rank holds the same weights
  double sum = 0;
  for (const auto& p : net->parameters()) sum += p.sum().item<double>();
  if (dist.rank() == 0) std::cout << "weights " << std::hexfloat << sum << "\n";
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
