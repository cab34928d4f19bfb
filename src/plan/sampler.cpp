#include "scaletrain/sampler.h"

#include <algorithm>
#include <numeric>
#include <random>
#include <string>

#include "scaletrain/error.h"

namespace scaletrain {

// Note [Global position]
// ~~~~~~~~~~~~~~~~~~~~~~
// A rank's own count of consumed samples means nothing at another world size: resumed on 1
// process, the position 80 of rank 0 of 2 skipped rank 1's 80 samples too, and the reverse
// trained samples twice. The state is therefore the global position G — entries of the epoch's
// permutation consumed by all ranks (G = the step's global batch x steps, since every rank
// advances alike) — and a rank's list after a load is the permutation from G on, split over the
// replicas of *this* run as an epoch is split. Every sample of the epoch is trained once: those
// before G by the saved run, those after by this one.

DistributedSampler::DistributedSampler(const SamplerOptions& o) : options_(o) {
  if (o.num_replicas < 1 || o.rank < 0 || o.rank >= o.num_replicas) {
    throw UsageError("DistributedSampler: rank " + std::to_string(o.rank) + " is outside [0, " +
                     std::to_string(o.num_replicas) + ")");
  }
  if (o.dataset_size < 0) throw UsageError("DistributedSampler: negative dataset size");
  split_from(0);
}

void DistributedSampler::split_from(int64_t origin) {
  origin_ = origin;
  const int64_t rest = std::max<int64_t>(0, options_.dataset_size - origin);
  const int64_t w = options_.num_replicas;
  num_samples_ = options_.drop_last ? rest / w : (rest + w - 1) / w;
}

SamplerState DistributedSampler::state() const {
  SamplerState s = state_;
  s.dataset_size = options_.dataset_size;
  return s;
}

void DistributedSampler::set_epoch(int64_t epoch) {
  if (epoch != state_.epoch) {
    state_.position = 0;
    split_from(0);
  }
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
  p.erase(p.begin(), p.begin() + std::min<int64_t>(origin_, static_cast<int64_t>(p.size())));
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
  const int64_t mine = (state_.position - origin_) / options_.num_replicas;
  const auto from = std::min(static_cast<size_t>(std::max<int64_t>(0, mine)), all.size());
  return {all.begin() + static_cast<std::ptrdiff_t>(from), all.end()};
}

bool DistributedSampler::is_padding(int64_t i) const {
  // Position i of this rank is global position origin + rank + i * replicas; beyond the data
  // set it is a repeat of an earlier sample.
  return origin_ + options_.rank + i * options_.num_replicas >= options_.dataset_size;
}

void DistributedSampler::load_state(const SamplerState& s) {
  if (s.position < 0) {
    throw UsageError("DistributedSampler: saved position " + std::to_string(s.position) +
                     " is negative");
  }
  if (s.dataset_size > 0 && s.dataset_size != options_.dataset_size) {
    throw UsageError("the saved data order is of a data set of " + std::to_string(s.dataset_size) +
                     " samples, and this one has " + std::to_string(options_.dataset_size) +
                     ": resume with the same data (and the same --limit-train), or start afresh");
  }
  state_.epoch = s.epoch;
  state_.position = s.position;
  split_from(s.position);
}

}  // namespace scaletrain
