#pragma once
// Small socket helpers shared by the launcher and the rendezvous (internal, not public API).

#include <string>
#include <vector>

namespace scaletrain::net {

/// A TCP socket bound to `port` (0: any free one) on 127.0.0.1 when `loopback_only`, else on
/// every IPv4 interface, with SO_REUSEADDR (as the rendezvous store uses it) and close-on-exec.
/// Listening when `listen` is set. Returns the descriptor, or -1 with errno set.
int bind_tcp(int port, bool loopback_only, bool listen);

/// The local port a bound socket holds, or -1.
int bound_port(int fd);

/// A TCP socket listening on `port` of the interface `host` names, close-on-exec, with
/// SO_REUSEADDR: a loopback address stays loopback (no other machine can even connect), an
/// address of this machine is that interface alone, and "" or "0.0.0.0" is every interface. A
/// name that this machine resolves to a loopback address but is not itself a loopback name
/// (Debian's /etc/hosts maps the machine's own name to 127.0.1.1, while the other machines
/// resolve it to its real address) listens on every interface. -1 with errno set when `host` is
/// another machine's (EADDRNOTAVAIL), the port is taken (EADDRINUSE) or the name does not
/// resolve.
int listen_on(const std::string& host, int port);

/// Whether `host` is a loopback name or address ("localhost", "127.x.y.z", "::1").
bool is_loopback_name(const std::string& host);

/// A TCP connection to host:port within `timeout_ms` (non-blocking, close-on-exec); -1 when
/// there is none.
int connect_to(const std::string& host, int port, int timeout_ms);

/// Sends all of `s` (MSG_NOSIGNAL: a closed peer is an error, not SIGPIPE); false on failure.
bool send_all(int fd, const std::string& s);

/// The complete lines at the start of `buf` ('\n' left out), taken out of it.
std::vector<std::string> take_lines(std::string& buf);

/// Appends what `fd` holds now to `buf`, without waiting. False when the peer closed, the socket
/// failed, or `buf` grew past 64 KiB without a line's end.
bool read_available(int fd, std::string& buf);

/// The numeric address of a connected socket's peer ("10.0.0.2"), or "" when unknown.
std::string peer_address(int fd);

}  // namespace scaletrain::net
