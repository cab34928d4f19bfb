#include "scaletrain/sampler.h"

#include <numeric>
#include <random>
#include <string>

#include "scaletrain/error.h"

namespace scaletrain {

DistributedSampler::DistributedSampler(const SamplerOptions& o) : options_(o) {
  if (o.num_replicas < 1 || o.rank < 0 || o.rank >= o.num_replicas) {
    throw UsageError("DistributedSampler: rank " + std::to_string(o.rank) + " is outside [0, " +
                     std::to_string(o.num_replicas) + ")");
  }
  if (o.dataset_size < 0) throw UsageError("DistributedSampler: negative dataset size");
  if (o.drop_last) {
    num_samples_ = o.dataset_size / o.num_replicas;
  } else {
    num_samples_ = (o.dataset_size + o.num_replicas - 1) / o.num_replicas;
  }
}

void DistributedSampler::set_epoch(int64_t epoch) {
  if (epoch != state_.epoch) state_.position = 0;
  state_.epoch = epoch;
}

std::vector<int64_t> DistributedSampler::permutation() const {
  std::vector<int64_t> p(static_cast<size_t>(options_.dataset_size));
  std::iota(p.begin(), p.end(), 0);
  if (options_.shuffle) {
    // A fixed generator and a hand-written Fisher-Yates: the same order on every platform and
    // standard library (std::shuffle's algorithm is implementation-defined).
    std::mt19937_64 gen(options_.seed * 1000003ULL + static_cast<uint64_t>(state_.epoch));
    for (size_t i = p.size(); i > 1; --i) {
      size_t j = static_cast<size_t>(gen() % i);
      std::swap(p[i - 1], p[j]);
    }
  }
  return p;
}

std::vector<int64_t> DistributedSampler::indices() const {
  std::vector<int64_t> p = permutation();
  const auto total = static_cast<size_t>(total_size());
  if (p.size() > total) {
    p.resize(total);  // drop_last: cut the tail
  } else {
    for (size_t i = 0; p.size() < total; ++i) p.push_back(p[i % p.size()]);  // pad
  }
  std::vector<int64_t> mine;
  mine.reserve(static_cast<size_t>(num_samples_));
  for (size_t i = static_cast<size_t>(options_.rank); i < total;
       i += static_cast<size_t>(options_.num_replicas)) {
    mine.push_back(p[i]);
  }
  return mine;
}

std::vector<int64_t> DistributedSampler::remaining() const {
  auto all = indices();
  const auto from =
      std::min(static_cast<size_t>(std::max<int64_t>(0, state_.position)), all.size());
  return {all.begin() + static_cast<std::ptrdiff_t>(from), all.end()};
}

bool DistributedSampler::is_padding(int64_t i) const {
  // Position i of this rank is global position rank + i * replicas; beyond the data set it is a
  // repeat of an earlier sample.
  return options_.rank + i * options_.num_replicas >= options_.dataset_size;
}

void DistributedSampler::load_state(const SamplerState& s) {
  if (s.position < 0 || s.position > num_samples_) {
    throw UsageError("DistributedSampler: saved position " + std::to_string(s.position) +
                     " is outside this rank's " + std::to_string(num_samples_) +
                     " samples; was the checkpoint made with another world size or data set?");
  }
  state_ = s;
}

}  // namespace scaletrain
