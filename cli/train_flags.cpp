// `scaletrain train`'s flags, by group (train_flags.h).

#include "train_flags.h"

#include "commands.h"

namespace scaletrain::cli {
namespace {

// A pipeline's own flags: each sets its field of PipelineTrainOptions only when given, so that
// the library can name a flag given to a strategy without a pipeline (nothing compares a value
// with its default).
void add_pipeline_flags(CLI::App* cmd, Args& a) {
  auto& p = a.o.pipeline;
  const auto text = [cmd](const char* flag, std::optional<std::string>& to, const char* help) {
    cmd->add_option_function<std::string>(
        flag, [&to](const std::string& v) { to = v; }, help);
  };
  const auto number = [cmd](const char* flag, auto& to, const char* help) {
    using T = typename std::decay_t<decltype(to)>::value_type;
    cmd->add_option_function<T>(
        flag, [&to](const T& v) { to = v; }, help);
  };
  text("--schedule", a.schedule,
       "Pipelines: gpipe (the default), 1f1b, interleaved (with --stages-per-device) or zb-h1 "
       "(zero bubble); the last two with --strategy pipeline, or grid of one replica");
  number("--stages-per-device", p.stages_per_device,
         "--schedule interleaved: stages on each device (pipeline) or process (grid); "
         "--balance then lists that many times more (default 1)");
  number("--chunks", p.chunks, "Pipelines: micro-batches per batch (default: twice the stages)");
  number("--split-size", p.split_size,
         "Pipeline: micro-batches of this many samples instead of --chunks (seed 000)");
  text("--balance", a.balance,
       "Pipelines: blocks per stage: auto or time (measured, the default), size, or N,M,...");
  text("--checkpoint-activations", a.checkpointing,
       "Pipeline, grid: recompute activations in backward: never (the default), except-last or "
       "always");
  number("--pipeline-stages", p.stages, "Grid: ranks per pipeline (default 2)");
}

}  // namespace

// The model, its data and where it computes.
void add_model_flags(CLI::App* cmd, Args& a) {
  auto& o = a.o;
  cmd->add_option("--model", o.model,
                  "toy, mlp, lenet, resnet18, resnet50, resnet101, gpt-tiny, gpt2-small or "
                  "llama-tiny; a Hugging Face folder of a Llama (config.json and safetensors, "
                  "docs/llama.md); or FILE.pt, a TorchScript module saved by Python "
                  "(docs/python_models.md)")
      ->capture_default_str();
  cmd->add_option("--dataset", o.dataset,
                  "fashion-mnist, synthetic, folder (ImageNet-style train/ and val/), or text "
                  "(train.bin and val.bin of token ids, for a GPT)")
      ->capture_default_str();
  cmd->add_option("--data-dir", o.data_dir,
                  "Folder of the IDX .gz files, of train/ and val/ for --dataset folder, or of "
                  "train.bin and val.bin for --dataset text")
      ->capture_default_str();
  cmd->add_option("--image-size", o.image_size, "Crop size of --dataset folder images")
      ->capture_default_str();
  cmd->add_option("--device", a.device, "auto, cpu, cuda or cuda:N")->capture_default_str();
  cmd->add_option("--peak-flops", o.peak_flops,
                  "One device's peak FLOP/s for the MFU in the summary, e.g. 989e12 (0: measured "
                  "by a short fp32 matmul on the CPU; unknown on CUDA)")
      ->capture_default_str();
  cmd->add_option("--amp", a.amp,
                  "Mixed precision: none, bf16 or fp16 (loss scaling; ddp). grid: bf16 autocast. "
                  "zero1, zero2, fsdp: bf16 parameters over fp32 master shards")
      ->capture_default_str();
  cmd->add_option("--workers", o.workers, "Loader threads per process, 0 to 256 (0: none)")
      ->capture_default_str();
  cmd->add_flag("--data-on-device", o.data_on_device,
                "Hold fashion-mnist or synthetic on the training device and gather each batch "
                "there (no loader threads, no copy per step; the same batches)");
  cmd->add_option("--init-weights", o.init_weights,
                  "Start from a state dict: a file (safetensors, or Python's "
                  "torch.save(dict(model.state_dict()))) or a folder of dcp.save "
                  "(torch.distributed.checkpoint)");
  cmd->add_flag("!--no-tensorboard", o.tensorboard, "No TensorBoard event file");
  cmd->add_flag("!--no-channels-last", o.channels_last,
                "Keep convolution weights and batches in the default (NCHW) memory layout");
  cmd->add_option("--limit-train", o.limit_train, "Use only the first N training samples");
  cmd->add_option("--limit-test", o.limit_test, "Use only the first N test samples");
}

// The optimizer and the schedule of its learning rate.
void add_optimizer_flags(CLI::App* cmd, TrainOptions& o) {
  cmd->add_option("--epochs", o.epochs)->capture_default_str();
  cmd->add_option("--batch-size", o.batch_size, "Global batch, split over the ranks")
      ->capture_default_str();
  cmd->add_option("--eval-batch-size", o.eval_batch_size,
                  "Evaluation's batch per replica (0: the training batch per replica)")
      ->capture_default_str();
  cmd->add_option("--optimizer", o.optimizer, "sgd or adam")->capture_default_str();
  cmd->add_option("--lr", o.lr)->capture_default_str();
  cmd->add_option("--momentum", o.momentum)->capture_default_str();
  cmd->add_option("--weight-decay", o.weight_decay)->capture_default_str();
  cmd->add_option("--lr-schedule", o.lr_schedule, "Learning-rate schedule: none, step or cosine")
      ->capture_default_str();
  cmd->add_option("--step-size", o.step_size, "Epochs between step-schedule decays");
  cmd->add_option("--gamma", o.gamma, "Step-schedule factor");
}

// The parallel strategy and its pipeline's shape.
void add_strategy_flags(CLI::App* cmd, Args& a) {
  cmd->add_option(
         "--strategy", a.strategy,
         "ddp (a process per device), dp (DataParallel over --devices), pipeline (the "
         "model's blocks over --devices), grid (a pipeline of --pipeline-stages ranks, "
         "replicated over the rest), zero1, zero2, fsdp (a process per device, sharding the "
         "optimizer state; and the gradients; and the parameters too)")
      ->capture_default_str();
  cmd->add_option("--devices", a.devices,
                  "dp and pipeline: the devices, e.g. cpu,cpu or cuda:0,cuda:1 (default: every "
                  "GPU, else cpu,cpu)");
  add_pipeline_flags(cmd, a);
  cmd->add_option(
         "--tp", a.o.tensor_parallel.size,
         "ddp, zero1, zero2, fsdp, grid: ranks per tensor-parallel group, each splitting one "
         "replica's model (grid: one stage's; gpt-tiny: its 256 tokens split, gpt2-small's "
         "50257 need --vocab-size 50304); the rest of the world is data parallel")
      ->capture_default_str();
  cmd->add_flag("--sequence-parallel", a.o.tensor_parallel.sequence_parallel,
                "With --tp: LayerNorms, dropout and residuals on a slice of the sequence");
  cmd->add_option(
         "--cp", a.o.context_parallel.size,
         "ddp, zero1, zero2, fsdp, grid: ranks per sequence (context parallelism: each rank "
         "a slice of every sequence, ring attention over them; GPTs and Llamas, "
         "--dropout 0, a --context that 2 x --cp divides)")
      ->capture_default_str();
  cmd->add_flag("--cp-in-order{false}", a.o.context_parallel.load_balanced,
                "With --cp: rank r takes chunk r of the sequence, instead of a head and a tail "
                "chunk each (causal load balancing)");
  cmd->add_option("--ep", a.o.expert_parallel.size,
                  "ddp, zero1, zero2, fsdp: ranks each MoE layer's experts are spread over (expert "
                  "parallelism: "
                  "blocks of this many data-parallel ranks, --experts / --ep experts each; "
                  "tokens travel to their experts by all-to-all)")
      ->capture_default_str();
  cmd->add_option("--experts", a.o.experts,
                  "gpt-tiny, gpt2-small, llama-tiny: MoE layers of this many experts in place "
                  "of the MLPs (0: dense)")
      ->capture_default_str();
  cmd->add_option("--top-k", a.o.top_k, "With --experts: the experts each token goes to")
      ->capture_default_str();
  cmd->add_option("--moe-every", a.o.moe_every,
                  "With --experts: the MLP of every n-th layer is a MoE (1: every layer)")
      ->capture_default_str();
  cmd->add_option("--aux-loss-coef", a.o.aux_loss_coef,
                  "With --experts: the load-balancing loss's weight (0: none)")
      ->capture_default_str();
}

// Steps, seed, and what the run writes: checkpoints, metrics.
void add_run_flags(CLI::App* cmd, Args& a) {
  auto& o = a.o;
  cmd->add_option("--accumulate", o.accumulate, "Batches per optimizer step");
  cmd->add_option("--max-grad-norm", o.max_grad_norm,
                  "Clip the gradients to this global L2 norm before each step (0: no clipping)")
      ->capture_default_str();
  cmd->add_option("--seed", a.seed,
                  "Seed of the weights and the data order (each rank's dropout draws from a "
                  "stream of its own, shared by a tensor-parallel group's ranks)")
      ->capture_default_str();
  cmd->add_option("--context", o.context,
                  "GPTs: the longest sequence and the text windows' length (0: the model's own, "
                  "gpt-tiny 64, gpt2-small 1024)")
      ->capture_default_str();
  cmd->add_option("--vocab-size", o.vocab_size,
                  "GPTs: the vocabulary's rows (0: the model's own, gpt-tiny 256, gpt2-small "
                  "50257); a larger one pads it, e.g. 50304 so that --tp divides it")
      ->capture_default_str();
  cmd->add_option("--dropout", o.dropout,
                  "mlp, GPTs: the probability of its dropout (GPTs: attention and residual; "
                  "with --tp the masks are the unsplit model's)")
      ->capture_default_str();
  cmd->add_flag("--checkpoint-blocks", o.checkpoint_blocks,
                "GPT, any strategy: recompute each transformer block in backward instead of "
                "keeping its activations");
  cmd->add_option("--out", o.out_dir, "Folder for checkpoints and metrics")->capture_default_str();
  cmd->add_option("--checkpoint-every", o.checkpoint_every,
                  "Steps between checkpoints (0: epochs)");
  cmd->add_option("--keep", o.keep, "Checkpoints kept")->capture_default_str();
  cmd->add_option("--checkpoint-format", a.checkpoint_format,
                  "dcp (gathered to rank 0, a folder in PyTorch's distributed checkpoint layout, "
                  "which Python's torch.distributed.checkpoint reads), full (one file, gathered "
                  "to rank 0) or sharded (zero1, zero2, fsdp: each rank writes its shard; "
                  "resumes at any world size)")
      ->capture_default_str();
  cmd->add_flag("--async-checkpoint", o.async_checkpoint,
                "Write checkpoints in the background: the steps wait only for a copy in memory");
  cmd->add_option("--resume", a.resume, "auto, none, or a checkpoint file")->capture_default_str();
  cmd->add_flag("--overwrite", o.overwrite,
                "--out holds another run: delete its checkpoints, metrics, event files, model.pt "
                "and run.json, and start afresh");
  cmd->add_option("--log-every", o.log_every, "Steps between metric lines")->capture_default_str();
}

// Fault-tolerant replicas (fault_tolerance.h).
void add_fault_tolerance_flags(CLI::App* cmd, Args& a) {
  cmd->add_flag("--fault-tolerant", a.fault_tolerant,
                "This job is one replica of several (ddp within it): a replica that fails is "
                "left out at the next step and the others go on; restarted, it takes the live "
                "state from a peer. --batch-size is the replica's");
  cmd->add_option("--lighthouse", a.lighthouse,
                  "--fault-tolerant: HOST:PORT of the lighthouse (scaletrain lighthouse) that "
                  "forms the replicas' quorum every step");
  cmd->add_option("--replica-id", a.replica_id,
                  "--fault-tolerant: this replica's number (0, 1, ...); its checkpoints go to "
                  "--out/replica-<id>")
      ->capture_default_str();
  cmd->add_option("--ft-timeout", a.ft_timeout,
                  "--fault-tolerant: seconds an exchange between replicas may wait before the "
                  "silent one is left out")
      ->capture_default_str();
}

// The processes: how many, how they talk, how long they wait for one another.
void add_process_flags(CLI::App* cmd, Args& a) {
  auto& o = a.o;
  cmd->add_option("--nproc-per-node", a.nproc,
                  "Processes when started by hand: a number or auto (one per GPU, else one per "
                  "CPU core, at most 8; as scaletrain run)")
      ->capture_default_str();
  cmd->add_option("--backend", a.backend, "gloo, nccl or auto")->capture_default_str();
  cmd->add_option("--timeout", o.timeout_s,
                  "Collective timeout in seconds: a rank waiting longer for the others in one "
                  "collective fails, naming it (300: room for a slow first step or a big "
                  "checkpoint; lower it to surface a lost rank sooner)")
      ->capture_default_str();
  cmd->add_option("--uneven-inputs", a.uneven_inputs,
                  "Ranks with different batch counts: fail (within a step, naming them) or join "
                  "(the others finish the epoch)")
      ->capture_default_str();
  cmd->add_flag("!--no-progress", o.progress, "No progress bar");
}

}  // namespace scaletrain::cli
