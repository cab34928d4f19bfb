#pragma once
// Small socket helpers shared by the launcher and the rendezvous (internal, not public API).

namespace scaletrain::net {

/// A TCP socket bound to `port` (0: any free one) on 127.0.0.1 when `loopback_only`, else on
/// every IPv4 interface, with SO_REUSEADDR (as the rendezvous store uses it) and close-on-exec.
/// Listening when `listen` is set. Returns the descriptor, or -1 with errno set.
int bind_tcp(int port, bool loopback_only, bool listen);

/// The local port a bound socket holds, or -1.
int bound_port(int fd);

}  // namespace scaletrain::net
