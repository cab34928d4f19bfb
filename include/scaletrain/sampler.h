#pragma once
// DistributedSampler: which sample indices each rank sees in an epoch, as PyTorch's
// torch.utils.data.DistributedSampler decides it — shuffled by (seed, epoch), split into
// disjoint per-rank slices, padded (by repeating from the start) or cut (drop_last) so every
// rank gets the same count. A pure, deterministic function of its options: no process group.
//
// Exact evaluation: with `pad` the last samples are seen twice; is_padding() tells which
// positions of a rank's list are such duplicates, so that metrics count every sample once.
//
// Resume: state() / load_state() carry the epoch and how many of this rank's indices were
// consumed, so that a run restarted mid-epoch continues with the next unseen index.
// Not thread-safe; one instance per rank.

#include <cstdint>
#include <vector>

namespace scaletrain {

struct SamplerOptions {
  int64_t dataset_size = 0;
  int num_replicas = 1;  // world size
  int rank = 0;
  bool shuffle = true;
  uint64_t seed = 0;
  bool drop_last = false;  // true: cut the tail instead of padding
};

struct SamplerState {
  int64_t epoch = 0;
  int64_t position = 0;  // indices of this rank already consumed in this epoch
};

class DistributedSampler {
 public:
  explicit DistributedSampler(const SamplerOptions& options);

  /// Samples per rank per epoch.
  int64_t num_samples() const { return num_samples_; }
  /// Samples over all ranks per epoch (num_samples * num_replicas).
  int64_t total_size() const { return num_samples_ * options_.num_replicas; }

  void set_epoch(int64_t epoch);
  int64_t epoch() const { return state_.epoch; }

  /// This rank's indices for the current epoch, all of them (from position 0).
  std::vector<int64_t> indices() const;
  /// The ones not consumed yet (from the saved position).
  std::vector<int64_t> remaining() const;
  /// Whether position i of this rank's list is a padded duplicate (only with padding).
  bool is_padding(int64_t i) const;

  /// Marks n more indices as consumed (the trainer calls it after each batch).
  void advance(int64_t n) { state_.position += n; }
  SamplerState state() const { return state_; }
  void load_state(const SamplerState& s);

  /// The global permutation of the epoch (before padding/cutting), for tests and tools.
  std::vector<int64_t> permutation() const;

 private:
  SamplerOptions options_;
  int64_t num_samples_ = 0;
  SamplerState state_;
};

}  // namespace scaletrain
