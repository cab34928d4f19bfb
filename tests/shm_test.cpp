// The shared-memory collectives of same-machine ranks (Note [Shared-memory reduce] in
// src/transport/shm.cpp), ranks as threads (and, once, a forked process).
#include "transport/shm.h"

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "scaletrain/error.h"

namespace scaletrain {
namespace {

using namespace std::chrono_literals;

SharedGroup::Options options(int rank, int size, int64_t chunk,
                             std::chrono::milliseconds timeout = 60s) {
  SharedGroup::Options o;
  o.rank = rank;
  o.size = size;
  o.chunk_floats = chunk;
  o.timeout = timeout;
  return o;
}

// Runs fn(rank, group) on `size` threads; returns each rank's error message ("" if none).
std::vector<std::string> run_group(int size, int64_t chunk,
                                   const std::function<void(int, SharedGroup&)>& fn,
                                   std::chrono::milliseconds timeout = 60s) {
  auto first = SharedGroup::create(options(0, size, chunk, timeout));
  std::vector<std::unique_ptr<SharedGroup>> groups;
  groups.push_back(std::move(first));
  for (int r = 1; r < size; ++r)
    groups.push_back(SharedGroup::attach(groups[0]->name(), options(r, size, chunk, timeout)));
  groups[0]->unlink();
  std::vector<std::string> errors(static_cast<size_t>(size));
  std::vector<std::thread> threads;
  for (int r = 0; r < size; ++r) {
    threads.emplace_back([&, r] {
      try {
        fn(r, *groups[static_cast<size_t>(r)]);
      } catch (const Error& e) {
        errors[static_cast<size_t>(r)] = e.what();
      }
      groups[static_cast<size_t>(r)].reset();  // as a DistributedDataParallel going away
    });
  }
  for (auto& t : threads) t.join();
  return errors;
}

float value(int rank, int64_t i, int round) {
  return static_cast<float>(i) * 0.1f + static_cast<float>(rank) * 1.7f + 0.3f * round;
}

class SharedAllreduce : public ::testing::TestWithParam<int> {};

// Several chunks (the last one short), several rounds: every rank gets, bit for bit, the sum
// taken in rank order.
TEST_P(SharedAllreduce, SumsInRankOrderOnEveryRank) {
  const int size = GetParam();
  const int64_t chunk = 1000, n = 2503;
  auto errors = run_group(size, chunk, [&](int rank, SharedGroup& g) {
    for (int round = 0; round < 3; ++round) {
      std::vector<float> data(n);
      for (int64_t i = 0; i < n; ++i) data[static_cast<size_t>(i)] = value(rank, i, round);
      g.allreduce_sum(data.data(), n, "test all-reduce");
      for (int64_t i = 0; i < n; ++i) {
        float expect = value(0, i, round);
        for (int r = 1; r < size; ++r) expect += value(r, i, round);
        if (data[static_cast<size_t>(i)] != expect) {
          throw Error("rank " + std::to_string(rank) + " round " + std::to_string(round) +
                      " element " + std::to_string(i) + ": " +
                      std::to_string(data[static_cast<size_t>(i)]) +
                      " != " + std::to_string(expect));
        }
      }
    }
  });
  for (auto& e : errors) EXPECT_EQ(e, "");
}

INSTANTIATE_TEST_SUITE_P(Sizes, SharedAllreduce, ::testing::Values(2, 3, 4));

// The float all-gather: parts of 0, 1, an odd count and several chunks (the last one short),
// mixed with all-reduces: every rank gets every rank's part, bit for bit, in rank order.
TEST_P(SharedAllreduce, AllgatherGivesEveryRanksPartOnEveryRank) {
  const int size = GetParam();
  const int64_t chunk = 1000;
  auto errors = run_group(size, chunk, [&](int rank, SharedGroup& g) {
    int round = 0;
    for (const int64_t n : {int64_t{0}, int64_t{1}, int64_t{999}, int64_t{2503}}) {
      std::vector<float> mine(static_cast<size_t>(n)), out(static_cast<size_t>(n * size), -1);
      for (int64_t i = 0; i < n; ++i) mine[static_cast<size_t>(i)] = value(rank, i, round);
      g.allgather(mine.data(), n, out.data(), "test all-gather");
      for (int r = 0; r < size; ++r) {
        for (int64_t i = 0; i < n; ++i) {
          if (out[static_cast<size_t>(r * n + i)] != value(r, i, round)) {
            throw Error("rank " + std::to_string(rank) + ", n " + std::to_string(n) + ": rank " +
                        std::to_string(r) + "'s element " + std::to_string(i) + " is " +
                        std::to_string(out[static_cast<size_t>(r * n + i)]));
          }
        }
      }
      std::vector<float> ones(7, 1.0f);  // an all-reduce between: the slots are shared
      g.allreduce_sum(ones.data(), 7, "test all-reduce");
      if (ones[6] != static_cast<float>(size)) throw Error("the all-reduce between went wrong");
      ++round;
    }
  });
  for (auto& e : errors) EXPECT_EQ(e, "");
}

// Back-to-back all-gathers, mixed with all-reduces, never read a value of another round.
TEST(SharedGroup, AllgathersBackToBackKeepTheirRounds) {
  const int size = 3;
  auto errors = run_group(size, 16, [&](int rank, SharedGroup& g) {
    for (int round = 0; round < 200; ++round) {
      auto all = g.allgather(rank * 1000 + round, "test all-gather");
      for (int r = 0; r < size; ++r) {
        if (all[static_cast<size_t>(r)] != r * 1000 + round) throw Error("stale flag");
      }
      if (round % 7 == 0) {
        float x = 1.0f;
        g.allreduce_sum(&x, 1, "test all-reduce");
        if (x != static_cast<float>(size)) throw Error("bad sum");
      }
    }
  });
  for (auto& e : errors) EXPECT_EQ(e, "");
}

// A rank whose group goes away (its thread unwinding an error) fails the others at once, long
// before the collective timeout.
TEST(SharedGroup, ARankThatLeavesFailsTheOthersAtOnce) {
  const auto t0 = std::chrono::steady_clock::now();
  auto errors = run_group(2, 16, [&](int rank, SharedGroup& g) {
    if (rank == 1) throw Error("rank 1 gave up");
    g.allgather(1, "the uneven-input check of step 3");
  });
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 5s);
  EXPECT_NE(errors[0].find("rank 0 of 2: the uneven-input check of step 3 failed: rank 1 left"),
            std::string::npos)
      << errors[0];
}

// A rank that stalls: the others time out after the collective timeout, naming it.
TEST(SharedGroup, TimeoutNamesTheRanksThatNeverArrived) {
  auto errors = run_group(
      3, 16,
      [&](int rank, SharedGroup& g) {
        if (rank == 2) {
          std::this_thread::sleep_for(3s);  // alive, but never joins (and leaves long after)
          return;
        }
        float x = 1;
        g.allreduce_sum(&x, 1, "all-reduce of gradient bucket 0 of 1");
      },
      300ms);
  for (int r : {0, 1}) {
    const auto& e = errors[static_cast<size_t>(r)];
    EXPECT_NE(e.find("all-reduce of gradient bucket 0 of 1 timed out"), std::string::npos) << e;
    EXPECT_NE(e.find("rank(s) 2 never joined it"), std::string::npos) << e;
  }
}

// A rank in another process that dies without a word (no destructor ran: SIGKILL, _exit).
TEST(SharedGroup, ADeadProcessIsNoticed) {
  auto g = SharedGroup::create(options(0, 2, 16));
  const pid_t child = fork();
  if (child == 0) {
    auto mine = SharedGroup::attach(g->name(), options(1, 2, 16));
    _exit(mine ? 0 : 1);  // no destructor: the group is not told
  }
  ASSERT_GT(child, 0);
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_EQ(WEXITSTATUS(status), 0);
  g->unlink();
  const auto t0 = std::chrono::steady_clock::now();
  try {
    g->allgather(1, "test all-gather");
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("exited before joining it"), std::string::npos)
        << e.what();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 5s);
}

TEST(SharedGroup, AttachRefusesWhatItCannotUse) {
  EXPECT_THROW(SharedGroup::attach("/scaletrain-no-such-segment", options(1, 2, 16)), Error);
  auto g = SharedGroup::create(options(0, 2, 16));
  EXPECT_THROW(SharedGroup::attach(g->name(), options(1, 2, 32)), Error);  // another size
  EXPECT_THROW(SharedGroup::attach(g->name(), options(2, 2, 16)), Error);  // rank out of range
  g->unlink();
}

}  // namespace
}  // namespace scaletrain
