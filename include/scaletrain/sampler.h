#pragma once
// DistributedSampler: which sample indices each rank sees in an epoch, as PyTorch's
// torch.utils.data.DistributedSampler decides it — shuffled by (seed, epoch), split into
// disjoint per-rank slices, padded (by repeating from the start) or cut (drop_last) so every
// rank gets the same count. A pure, deterministic function of its options: no process group.
//
// Exact evaluation: with `pad` the last samples are seen twice; is_padding() tells which
// positions of a rank's list are such duplicates, so that metrics count every sample once.
//
// Resume (Note [Global position]): state() carries the epoch and the *global* position — how
// many entries of the epoch's permutation the ranks together consumed — so that a run restarted
// mid-epoch, at the same or at another number of replicas, trains each remaining sample of the
// epoch exactly once. After load_state(), a rank's list is the rest of the permutation from that
// position, split over the replicas as an epoch is (rank r takes entries r, r + N, ...), padded
// or cut as an epoch is. At position 0 this is PyTorch's split exactly.
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
  /// Entries of the epoch's permutation consumed by all replicas together (each replica's
  /// advance() counts num_replicas times). Not a rank's own count: it means the same at any
  /// number of replicas.
  int64_t position = 0;
  /// The data set's size when the state was taken (0: unknown); load_state() refuses another.
  int64_t dataset_size = 0;
};

class DistributedSampler {
 public:
  explicit DistributedSampler(const SamplerOptions& options);

  /// Samples of this rank's list in the current epoch (from the position the epoch or the loaded
  /// state started at).
  int64_t num_samples() const { return num_samples_; }
  /// Samples of that list over all ranks (num_samples * num_replicas).
  int64_t total_size() const { return num_samples_ * options_.num_replicas; }

  /// A new epoch from its start (a different one than the current: position back to 0).
  void set_epoch(int64_t epoch);
  int64_t epoch() const { return state_.epoch; }

  /// This rank's list for the current epoch, all of it (from where the epoch, or the loaded
  /// state, started).
  std::vector<int64_t> indices() const;
  /// The entries of it not consumed yet.
  std::vector<int64_t> remaining() const;
  /// Whether position i of this rank's list is a padded duplicate (only with padding).
  bool is_padding(int64_t i) const;

  /// Marks n more of this rank's indices as consumed (every rank advances alike; the trainer
  /// calls it after each batch): the global position moves by n * num_replicas.
  void advance(int64_t n) { state_.position += n * options_.num_replicas; }
  SamplerState state() const;
  /// Continues from a saved state, taken at any number of replicas. Throws UsageError for a
  /// negative position or one of a data set of another size.
  void load_state(const SamplerState& s);

  /// The global permutation of the epoch (before padding/cutting), for tests and tools.
  std::vector<int64_t> permutation() const;

 private:
  void split_from(int64_t origin);

  SamplerOptions options_;
  int64_t origin_ = 0;  // the global position this rank's list starts at
  int64_t num_samples_ = 0;
  SamplerState state_;
};

}  // namespace scaletrain
