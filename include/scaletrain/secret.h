#pragma once
// The job's secret (Note [Job secret] in src/launch/secret.cpp; docs/launcher.md, "Threat
// model"): every process of a job proves that it holds it before any server of the job — the
// workers' store, the elastic rendezvous, the lighthouse of fault-tolerant replicas — reads a
// byte of what it says. A process that can reach a port but holds no secret learns nothing and
// changes nothing.
//
// Where it comes from, first found first:
//   SCALETRAIN_SECRET        the secret itself (an environment variable: never a command line,
//                            which every user of the machine can read)
//   SCALETRAIN_SECRET_FILE   a file holding it (its first line); created with a new random
//                            secret, mode 0600, when it does not exist, so that processes
//                            sharing a file system need only agree on the path
// `scaletrain run` makes one for its workers where none is given (a job of one node), and hands
// it to them in SCALETRAIN_WORLD_SECRET.

#include <string>

namespace scaletrain {

/// The environment variables, by name.
inline constexpr const char* kSecretEnv = "SCALETRAIN_SECRET";
inline constexpr const char* kSecretFileEnv = "SCALETRAIN_SECRET_FILE";
/// The launcher's secret for its workers' world (the user's where given, else a new one).
inline constexpr const char* kWorldSecretEnv = "SCALETRAIN_WORLD_SECRET";

/// A secret is at least this long (characters): shorter ones are guessable.
inline constexpr size_t kMinSecretLength = 16;

/// The user's secret: SCALETRAIN_SECRET, else the file SCALETRAIN_SECRET_FILE names (created
/// when missing); "" when neither variable is set. Throws UsageError naming the variable and
/// the fix for a secret that is too short, a file others may read, or one that cannot be read.
std::string user_secret();

/// The secret in `path` (its first line, surrounding blanks removed). A missing file is created
/// with a new random secret when `create` (mode 0600, atomically: of several processes creating
/// it at once, every one reads the same secret). Throws UsageError naming `path` and the fix
/// when it cannot be read or created, is readable by other users, or holds a short secret.
std::string read_secret_file(const std::string& path, bool create = true);

/// 32 bytes from the system's random source, as 64 hexadecimal characters.
std::string generate_secret();

}  // namespace scaletrain
