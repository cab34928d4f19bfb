#pragma once
// One error style for the whole library (STYLE.md, rule 5): exceptions whose message carries the
// offending value, the rank where it happened, and the fix.

#include <stdexcept>
#include <string>

namespace scaletrain {

/// Any failure scaletrain reports. what() is a complete sentence meant for the user.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// Bad input from the user (a flag, an environment variable, a config value). The command-line
/// tool exits with status 2 for these, before starting any work.
class UsageError : public Error {
 public:
  using Error::Error;
};

}  // namespace scaletrain
