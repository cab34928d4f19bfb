// A model defined in Python (make_model.py saves it with torch.jit.save), trained from C++ with
// data of the program's own; the trained weights keep Python's names, so that
// model.load_state_dict(torch.load("OUT/model.pt")) takes them back in Python.
//   python make_model.py spirals.pt
//   scaletrain run --nproc-per-node 2 -- ./python_model_example spirals.pt runs/x
#include <scaletrain/data.h>
#include <scaletrain/error.h>
#include <scaletrain/python_model.h>
#include <scaletrain/trainer.h>
#include <torch/torch.h>

#include <iostream>

// Points of two interleaved spirals, and which spiral each is on.
scaletrain::Dataset spirals(int64_t n, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  auto y = torch::randint(2, {n}, gen, torch::kLong);
  auto t = torch::rand({n}, gen) * 3 * M_PI;
  auto turn = t + M_PI * y.to(torch::kFloat);
  auto x = torch::stack({t * torch::cos(turn), t * torch::sin(turn)}, 1) / 10 +
           0.03 * torch::randn({n, 2}, gen);
  return {x, y, 2};
}

int run(int argc, char** argv) {
  if (argc < 3) throw scaletrain::UsageError("usage: python_model_example MODEL.pt OUT_DIR");
  const std::string file = argv[1];
  scaletrain::load_python_model(file);  // a file it cannot train: a UsageError, before joining
  auto dist = scaletrain::init_process_group();
  scaletrain::TrainTask task;
  task.model = [file] { return scaletrain::load_python_model(file); };
  task.train_data = scaletrain::in_memory(spirals(4096, 1));
  task.test_data = scaletrain::in_memory(spirals(1024, 2));
  task.optimizer = [](const std::vector<torch::Tensor>& p) {
    return std::make_unique<torch::optim::Adam>(p, torch::optim::AdamOptions(0.01));
  };
  scaletrain::TrainerOptions o;
  o.strategy = scaletrain::Strategy::kFsdp;  // an nn.Sequential: one unit per block
  o.epochs = 20;
  o.batch_size = 128;
  o.out_dir = argv[2];
  o.progress = false;
  o.device = at::kCPU;
  auto result = scaletrain::train(task, o, dist);
  if (dist.rank() == 0) std::cout << "test accuracy " << result.test_accuracy << "\n";
  return result.test_accuracy > 0.9 ? 0 : 1;
}

// A misuse (a missing file, a module that cannot train) is a UsageError: exit 2.
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
