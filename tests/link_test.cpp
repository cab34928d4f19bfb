// Point-to-point messages through shared-memory links (Note [Shared-memory links] in
// src/transport/link.cpp), ranks as threads.
#include "transport/link.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <functional>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "scaletrain/error.h"

namespace scaletrain {
namespace {

using namespace std::chrono_literals;

SharedLink::Options options(int rank, int peer, int64_t ring,
                            std::chrono::milliseconds timeout = 60s) {
  SharedLink::Options o;
  o.rank = rank;
  o.peer = peer;
  o.ring_bytes = ring;
  o.timeout = timeout;
  return o;
}

// `size` ranks as threads, each linked with `size` - 1 others (rank r with (r ± 1) mod size
// when `ring_only`), running fn(rank, links); returns each rank's error ("" if none).
std::vector<std::string> run_ranks(int size, int64_t ring,
                                   const std::function<void(int, LinkSet&)>& fn,
                                   std::chrono::milliseconds timeout = 60s) {
  std::vector<LinkSet> sets(static_cast<size_t>(size));
  for (int a = 0; a < size; ++a) {
    for (int b = a + 1; b < size; ++b) {
      auto first = SharedLink::create(options(a, b, ring, timeout));
      auto second = SharedLink::attach(first->name(), options(b, a, ring, timeout));
      first->unlink();
      sets[static_cast<size_t>(a)].add(b, std::move(first));
      sets[static_cast<size_t>(b)].add(a, std::move(second));
    }
  }
  std::vector<std::string> errors(static_cast<size_t>(size));
  std::vector<std::thread> threads;
  for (int r = 0; r < size; ++r) {
    threads.emplace_back([&, r] {
      try {
        fn(r, sets[static_cast<size_t>(r)]);
      } catch (const Error& e) {
        errors[static_cast<size_t>(r)] = e.what();
      }
      sets[static_cast<size_t>(r)] = LinkSet();  // as a pipeline going away
    });
  }
  for (auto& t : threads) t.join();
  return errors;
}

std::vector<int32_t> payload(int from, int32_t tag, size_t n) {
  std::vector<int32_t> v(n);
  std::iota(v.begin(), v.end(), from * 100000 + tag * 1000);
  return v;
}

void send(LinkSet& links, int peer, int32_t tag, const std::vector<int32_t>& v) {
  links.wait_sent(peer, links.send(peer, tag, v.data(), v.size() * sizeof(int32_t)), "a send");
}

std::vector<int32_t> recv(LinkSet& links, int peer, int32_t tag, size_t n) {
  std::vector<int32_t> v(n, -1);
  links.wait_received(peer, links.post(peer, tag, v.data(), n * sizeof(int32_t)), "a receive");
  return v;
}

TEST(SharedLinks, MessagesMatchByTagInOrderPerTag) {
  // Rank 0 sends tags 1, 2, 1, 0 bytes under 3; rank 1 asks for 2 first, then 3, then the 1s.
  auto errors = run_ranks(2, 4096, [](int rank, LinkSet& links) {
    if (rank == 0) {
      const auto a = payload(0, 1, 10), b = payload(0, 2, 7), c = payload(0, 1, 3);
      std::vector<uint64_t> t = {links.send(1, 1, a.data(), 40), links.send(1, 2, b.data(), 28),
                                 links.send(1, 1, c.data(), 12), links.send(1, 3, nullptr, 0)};
      for (auto ticket : t) links.wait_sent(1, ticket, "a send");
    } else {
      EXPECT_EQ(recv(links, 0, 2, 7), payload(0, 2, 7));
      links.wait_received(0, links.post(0, 3, nullptr, 0), "an empty message");
      EXPECT_EQ(recv(links, 0, 1, 10), payload(0, 1, 10));
      EXPECT_EQ(recv(links, 0, 1, 3), payload(0, 1, 3));
    }
  });
  EXPECT_EQ(errors, std::vector<std::string>(2));
}

TEST(SharedLinks, MessagesLongerThanTheRingCrossBothWaysAtOnce) {
  // Both ranks wait for their own 1 MB send first, through 256-byte rings: each wait must read
  // what the other writes, or the two would wait on each other's full ring for ever.
  for (int64_t ring : {64, 256, 1000}) {
    auto errors = run_ranks(2, ring, [](int rank, LinkSet& links) {
      const int peer = 1 - rank;
      const auto mine = payload(rank, 4, 250000 + static_cast<size_t>(rank));
      std::vector<int32_t> theirs(250000 + static_cast<size_t>(peer));
      const auto in = links.post(peer, 4, theirs.data(), theirs.size() * sizeof(int32_t));
      send(links, peer, 4, mine);
      links.wait_received(peer, in, "a long message");
      EXPECT_EQ(theirs, payload(peer, 4, theirs.size()));
    });
    EXPECT_EQ(errors, std::vector<std::string>(2)) << "ring " << ring;
  }
}

TEST(SharedLinks, ThreeRanksWhoseRingsAreAllFullDoNotWaitInACycle) {
  // Every rank sends 400 KB to the next through 4 KB rings and waits for that send before it
  // receives from the previous: each wait has to drain the link it is not waiting on.
  auto errors = run_ranks(3, 4096, [](int rank, LinkSet& links) {
    const int next = (rank + 1) % 3, previous = (rank + 2) % 3;
    send(links, next, 7, payload(rank, 7, 100000));
    EXPECT_EQ(recv(links, previous, 7, 100000), payload(previous, 7, 100000));
  });
  EXPECT_EQ(errors, std::vector<std::string>(3));
}

TEST(SharedLinks, APeerThatLeavesFailsItsWaiterAtOnceNamingIt) {
  const auto start = std::chrono::steady_clock::now();
  auto errors = run_ranks(
      2, 4096,
      [](int rank, LinkSet& links) {
        if (rank == 1) throw Error("rank 1 failed on its own");
        recv(links, 1, 0, 4);
      },
      120s);
  EXPECT_LT(std::chrono::steady_clock::now() - start, 10s);
  EXPECT_NE(errors[0].find("rank 0: a receive: rank 1 left"), std::string::npos) << errors[0];
}

TEST(SharedLinks, AWaitPastTheTimeoutNamesThePeer) {
  auto errors = run_ranks(
      2, 4096,
      [](int rank, LinkSet& links) {
        if (rank == 0) {
          recv(links, 1, 0, 4);
        } else {
          std::this_thread::sleep_for(1500ms);
        }
      },
      300ms);
  EXPECT_NE(errors[0].find("rank 0: a receive: rank 1 never answered: timed out after 0.3 s"),
            std::string::npos)
      << errors[0];
}

TEST(SharedLinks, AMessageOfAnotherLengthIsAnError) {
  auto errors = run_ranks(2, 4096, [](int rank, LinkSet& links) {
    if (rank == 0) {
      send(links, 1, 9, payload(0, 9, 5));
    } else {
      recv(links, 0, 9, 4);
    }
  });
  EXPECT_NE(errors[1].find("under tag 9 has 20 bytes; the receive posted for it expects 16"),
            std::string::npos)
      << errors[1];
}

TEST(SharedLinks, ManyMessagesOfOddLengthsWrapTheRingAtEveryOffset) {
  // 200 messages of 0 to 199 ints through a 100-byte ring: headers and bodies split at every
  // offset of the wrap. The sender queues them all before waiting for any.
  auto errors = run_ranks(2, 100, [](int rank, LinkSet& links) {
    if (rank == 0) {
      std::vector<std::vector<int32_t>> all;
      std::vector<uint64_t> tickets;
      for (int i = 0; i < 200; ++i) all.push_back(payload(0, i % 7, static_cast<size_t>(i)));
      for (int i = 0; i < 200; ++i) {
        tickets.push_back(links.send(1, i % 7, all[static_cast<size_t>(i)].data(),
                                     all[static_cast<size_t>(i)].size() * sizeof(int32_t)));
      }
      for (auto t : tickets) links.wait_sent(1, t, "a send");
    } else {
      for (int i = 0; i < 200; ++i) {
        ASSERT_EQ(recv(links, 0, i % 7, static_cast<size_t>(i)),
                  payload(0, i % 7, static_cast<size_t>(i)))
            << "message " << i;
      }
    }
  });
  EXPECT_EQ(errors, std::vector<std::string>(2));
}

TEST(SharedLinks, AnEmptyMessageIntoAFullRingIsSentOnceItsHeaderIs) {
  auto errors = run_ranks(2, 64, [](int rank, LinkSet& links) {
    if (rank == 0) {
      const auto fill = payload(0, 1, 12);  // 48 bytes + a 16-byte header: the ring is full
      const auto a = links.send(1, 1, fill.data(), 48);
      const auto b = links.send(1, 2, nullptr, 0);
      links.wait_sent(1, a, "the filler");
      links.wait_sent(1, b, "the empty message");
    } else {
      std::this_thread::sleep_for(50ms);  // the sender waits on the full ring meanwhile
      EXPECT_EQ(recv(links, 0, 1, 12), payload(0, 1, 12));
      links.wait_received(0, links.post(0, 2, nullptr, 0), "the empty message");
    }
  });
  EXPECT_EQ(errors, std::vector<std::string>(2));
}

TEST(SharedLinks, ASendDroppedUnwaitedStillSendsItsBytes) {
  // After a failure a caller may drop a send it never waited for; the link holds the buffer
  // until it is written (the owner), so the peer gets the bytes, not freed memory.
  auto errors = run_ranks(2, 256, [](int rank, LinkSet& links) {
    if (rank == 0) {
      auto data = std::make_shared<std::vector<int32_t>>(payload(0, 3, 5000));
      links.send(1, 3, data->data(), data->size() * sizeof(int32_t), data);
      data.reset();
      send(links, 1, 4, payload(0, 4, 1));  // waits: everything before it is written too
    } else {
      EXPECT_EQ(recv(links, 0, 3, 5000), payload(0, 3, 5000));
      EXPECT_EQ(recv(links, 0, 4, 1), payload(0, 4, 1));
    }
  });
  EXPECT_EQ(errors, std::vector<std::string>(2));
}

TEST(SharedLinks, AReceiveWithdrawnWhileItIsReadPassesItsMessageOver) {
  auto errors = run_ranks(2, 128, [](int rank, LinkSet& links) {
    if (rank == 0) {
      send(links, 1, 5, payload(0, 5, 4000));  // long: read in many parts
      send(links, 1, 5, payload(0, 6, 3));
    } else {
      std::vector<int32_t> first(4000);
      const auto t = links.post(0, 5, first.data(), first.size() * sizeof(int32_t));
      while (first[0] != payload(0, 5, 1)[0]) links.received(0, t);  // its reading began
      links.withdraw(0, t);
      first.assign(1, 0);  // the buffer is gone: nothing may write into it any more
      EXPECT_EQ(recv(links, 0, 5, 3), payload(0, 6, 3));
    }
  });
  EXPECT_EQ(errors, std::vector<std::string>(2));
}

TEST(SharedLinks, ALinkBrokenByAMessageOfAnotherLengthStaysBroken) {
  auto errors = run_ranks(2, 4096, [](int rank, LinkSet& links) {
    if (rank == 0) {
      send(links, 1, 9, payload(0, 9, 5));
      send(links, 1, 9, payload(0, 9, 4));
    } else {
      EXPECT_THROW(recv(links, 0, 9, 4), Error);
      recv(links, 0, 9, 4);  // the stream is out of step: the same error again
    }
  });
  EXPECT_NE(errors[1].find("under tag 9 has 20 bytes; the receive posted for it expects 16"),
            std::string::npos)
      << errors[1];
}

TEST(SharedLinks, AttachRefusesASegmentOfAnotherRingSize) {
  auto first = SharedLink::create(options(0, 1, 4096));
  EXPECT_THROW(SharedLink::attach(first->name(), options(1, 0, 8192)), Error);
  EXPECT_THROW(SharedLink::attach("/scaletrain-no-such-link", options(1, 0, 4096)), Error);
  first->unlink();
}

}  // namespace
}  // namespace scaletrain
