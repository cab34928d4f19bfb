#pragma once
// The zoo: what `scaletrain train` trains — the zoo's models and built-in data sets by name, the
// optimizer and learning-rate schedule by name, and the fault injection of the resume tests
// (SCALETRAIN_KILL_AT_STEP). A target of its own (scaletrain_zoo), which the command line and
// the tests link and the library never does; a program trains its own model with train() and a
// TrainTask (scaletrain/trainer.h).

#include <string>

#include "scaletrain/trainer.h"
#include "zoo_models.h"

namespace scaletrain {

struct TrainOptions : TrainerOptions {
  std::string model = "lenet";            // models.h's names
  std::string dataset = "fashion-mnist";  // "synthetic", or "folder": data_dir holds train/
                                          // and val/, ImageNet-style (image_folder.h)
  std::string data_dir = "/usr/share/datasets/fashion-mnist";
  int64_t image_size = 224;  // folder data: crop size
  int64_t limit_train = 0;   // >0: use only the first N training samples
  int64_t limit_test = 0;
  std::string optimizer = "sgd";  // "sgd" or "adam"
  double lr = 0.05;
  double momentum = 0.9;
  double weight_decay = 5e-4;
  std::string lr_schedule = "none";  // "none", "step" (x gamma every step_size epochs), "cosine"
  int step_size = 2;
  double gamma = 0.5;
  std::string init_weights;        // a state dict to start from: a file or a DCP folder
  double dropout = 0;              // mlp, GPTs: their dropout's probability
  bool checkpoint_blocks = false;  // GPT: recompute each block in backward (ModelOptions)
  int64_t context = 0;             // GPTs: the longest sequence, the text windows' length
  int64_t experts = 0;             // GPTs, Llama: MoE layers of this many experts (0: dense MLPs)
  int64_t top_k = 2;               //   each token's experts
  int64_t moe_every = 1;           //   the MLP of every n-th layer a MoE
  double aux_loss_coef = 0.01;     //   the load-balancing loss's coefficient
  int64_t vocab_size = 0;  // GPTs: the vocabulary's rows (0: the model's own); a larger one pads
                           // it, so that a tensor-parallel degree divides it
                           // (0: the size's own: gpt-tiny 64, gpt2-small 1024)
};

/// The zoo's task for `options`: the model by name, the data set by name, the optimizer and
/// learning-rate schedule by name.
TrainTask zoo_task(const TrainOptions& options);

/// validate(options, world) of the trainer, and the zoo's names and numbers.
void validate(const TrainOptions& options, int world_size);
/// The process-group backend for a run of `options` on a node with `gpus` GPUs: `requested`,
/// unless it is "auto" and the tensors the trainer's collectives carry live on the CPU
/// (--device cpu; dp and pipeline whose first device is the CPU), which NCCL cannot carry:
/// then "gloo".
std::string train_backend(const TrainOptions& options, const std::string& requested, int gpus);

/// train(zoo_task(options), options, dist).
TrainResult train(const TrainOptions& options, const Dist& dist);

}  // namespace scaletrain
