#pragma once
// What tests/scripts/attacker.py reports against what the attacked server logged
// (fault_tolerant_job_test.cpp, multinode_test.cpp).

#include <gtest/gtest.h>

#include <regex>
#include <string>

namespace scaletrain::testing {

// Connections a server's log says it refused (net::RefusalLog): "refused a connection from ..."
// is one, "refused N connections, the first from ..." N.
inline long refused_connections(const std::string& log) {
  long n = 0;
  const std::regex line("refused (a connection|([0-9]+) connections)");
  for (auto it = std::sregex_iterator(log.begin(), log.end(), line); it != std::sregex_iterator();
       ++it) {
    n += (*it)[2].matched ? std::stol((*it)[2]) : 1;
  }
  return n;
}

// The attacker's report `attacker` ("attacks: T tried, R refused; C connections in all"): every
// attack refused, guessed proofs, the flood and the slow connections among them, and each of its
// connections counted in `server_log` as refused. Returns how many attacks it tried (0 when it
// never finished).
inline int expect_every_attack_refused(const std::string& attacker, const std::string& server_log) {
  std::smatch m;
  const bool summed = std::regex_search(
      attacker, m, std::regex("attacks: ([0-9]+) tried, ([0-9]+) refused; ([0-9]+) connections"));
  EXPECT_TRUE(summed) << "the attacker never finished\n" << attacker;
  if (!summed) return 0;
  EXPECT_EQ(m[1], m[2]) << attacker;
  EXPECT_EQ(attacker.find("NOT REFUSED"), std::string::npos) << attacker;
  EXPECT_NE(attacker.find("after guessing the secret"), std::string::npos) << attacker;
  EXPECT_NE(attacker.find("attack flood: 4000 connections: refused (4000 opened"),
            std::string::npos)
      << attacker;
  EXPECT_TRUE(std::regex_search(attacker, std::regex("attack slow: [0-9]+ connections.*: refused")))
      << attacker;
  // (The job's own connections that the flood crowded out at the door, and that were made
  // again, are counted too: at least the attacker's.)
  EXPECT_GE(refused_connections(server_log), std::stol(m[3])) << server_log;
  return std::stoi(m[1]);
}

}  // namespace scaletrain::testing
