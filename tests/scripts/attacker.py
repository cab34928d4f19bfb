#!/usr/bin/env python3
"""An outsider's attacks on a running job's control plane: a process that can reach a server's
port but does not hold the job's secret (docs/launcher.md, "Threat model"). It replays what an
outside security pass did to the previous version, where each of these changed the job:

  attacker.py lighthouse HOST:PORT [--flood N] [--slow N]
      join as replica 7 and read the job's settings (PyTorch's TCPStore wire protocol, and
      scaletrain's own store frames), forge the run's end (ft/done, ft/done/0/x = 1000000), ask
      as a donor at step 10^6; each sent bare and again after a proof made with a guessed secret
  attacker.py rendezvous HOST:PORT [--run-id ID] [--flood N] [--slow N]
      say DONE, join a phantom node (JOIN ...), the same after a guessed proof

then, against either: a flood of --flood connections opened as fast as they go and held, and
--slow connections that send a proof a byte every 0.5 s and never end it (a slow loris). Each
attack is a connection of its own (the flood, many); it is refused when the server sent nothing
but its challenge and a REFUSED line, and closed it (a flood: every one of its connections
within the server's deadline for a proof, and all but 64 of them at once). Prints a line per
attack ("attack NAME: refused (REFUSED wrong secret)" or "attack NAME: NOT REFUSED (...)"),
"every attack sent" once the last connection is open (what follows only waits for the server to
close them), and last "attacks: T tried, R refused; C connections in all". Exit status 0 when
every attack was refused, 1 otherwise, 2 on bad arguments. Standard library only: any Python 3
runs it.
"""

import argparse
import hashlib
import hmac
import os
import resource
import select
import socket
import struct
import sys
import threading
import time

MAGIC = b"SCALETRAIN-AUTH 1 "
# Secrets an attacker would try first; the job's is none of them.
GUESSES = ["", "scaletrain", "secret", "password", "0" * 64]
# The longest a server may keep a connection that proved nothing (GateLimits::deadline, 5 s),
# with room for a loaded machine.
PATIENCE_S = 12.0
# The most connections without a proof a server keeps at once (GateLimits::max_waiting), and how
# long after a flood it may take to close the rest.
MAX_WAITING = 64
SETTLE_S = 2.0


# ---- What the attacks say ------------------------------------------------------------------


def tcpstore(op, *args):
    """One request in PyTorch's TCPStore wire protocol (c10d/TCPStoreBackend.hpp): the query
    type, then each string as a uint64 length and its bytes; ADD's delta an int64."""
    types = {"validate": 0, "set": 1, "get": 3, "add": 4}
    out = struct.pack("<B", types[op])
    if op == "validate":
        return out + struct.pack("<I", 0x3C85F7CE)
    if op == "add":
        return out + struct.pack("<Q", len(args[0])) + args[0].encode() + struct.pack("<q", args[1])
    for a in args:
        b = a.encode()
        out += struct.pack("<Q", len(b)) + b
    return out


def frame(op, *parts):
    """One request in scaletrain's store frames (src/dist/store_wire.h)."""
    codes = {"set": 1, "get": 2, "add": 3}
    body = struct.pack("<BI", codes[op], len(parts))
    for p in parts:
        b = str(p).encode()
        body += struct.pack("<I", len(b)) + b
    return struct.pack("<I", len(body)) + body


def lighthouse_requests(speak, first=b""):
    """The lighthouse's keys (Note [Replica groups]) as an attacker writes them, each request
    after `first`: join as replica 7, read replica 0's request (the job's settings), forge the
    end, ask as a donor."""
    reqs = {
        "join as replica 7": [
            speak("set", "ft/reg/7/outsider", "outsider pid 7"),
            speak("add", "ft/beat/7/outsider", 1),
            speak("get", "ft/req/0"),
        ],
        "forge ft/done": [
            speak("set", "ft/done", "1000000"),
            speak("set", "ft/done/0/x", "1000000"),
        ],
        "ask as the donor at step 10^6": [
            speak("set", "ft/reg/7/donor", "outsider pid 8"),
            speak("set", "ft/req/7/donor", "donor-1 1000000 1 x"),
        ],
    }
    return {k: first + b"".join(v) for k, v in reqs.items()}


def rendezvous_requests(run_id):
    """The rendezvous's lines (Note [Elastic rendezvous]) as an attacker writes them."""
    return {
        "DONE": b"DONE\n",
        "phantom JOIN": f"JOIN {run_id} 1 29999 phantom:1 0\nBEAT\n".encode(),
    }


# ---- One connection ------------------------------------------------------------------------


def connect(host, port, timeout=5.0):
    s = socket.create_connection((host, port), timeout=timeout)
    s.settimeout(timeout)
    return s


def read_to_end(s, deadline, said=b""):
    """`said` and everything the server says after it until it closes (True) or `deadline`
    passes (False); once it said anything but its challenge and a refusal (it let the attacker
    in), half a second more."""
    while time.monotonic() < deadline:
        s.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            chunk = s.recv(65536)
        except socket.timeout:
            break
        except ConnectionError:
            return said, True
        if not chunk:
            return said, True
        said += chunk
        after = said.partition(b"\n")[2]
        if after and not b"REFUSED ".startswith(after[:8]) and not after.startswith(b"REFUSED "):
            deadline = min(deadline, time.monotonic() + 0.5)
    return said, False


def verdict(said, closed):
    """(refused, words): refused when the server said nothing but its challenge and a refusal,
    and closed the connection."""
    lines = said.split(b"\n")
    words = " / ".join(x.decode(errors="replace") for x in lines[1:] if x)
    if not said.startswith(MAGIC):
        return False, "no challenge: " + said[:80].decode(errors="replace")
    if not closed:
        return False, f"let in: the connection stayed open, the server having said: {words}"
    rest = [x for x in lines[1:] if x]
    if rest and all(x.startswith(b"REFUSED ") for x in rest):
        return True, words
    if not rest:
        return True, "closed without a word"
    return False, words


def bare(host, port, payload):
    """Sends `payload` at once, as a client that never heard of a handshake does."""
    s = connect(host, port)
    try:
        s.sendall(payload)
    except ConnectionError:
        pass
    said, closed = read_to_end(s, time.monotonic() + PATIENCE_S)
    s.close()
    return verdict(said, closed)


def guessed(host, port, secret, payload):
    """Answers the challenge with a proof made from a guessed secret, the payload right behind
    it (a server that read past a proof before checking it would take the payload)."""
    s = connect(host, port)
    hello = b""
    while b"\n" not in hello:
        chunk = s.recv(4096)
        if not chunk:
            break
        hello += chunk
    parts = hello.partition(b"\n")[0].decode(errors="replace").split()
    if len(parts) != 4:
        s.close()
        return verdict(hello, True)
    service, sn = parts[2], parts[3]
    cn = os.urandom(32).hex()
    mac = hmac.new(secret.encode(), f"client {service} {sn} {cn}".encode(), hashlib.sha256)
    try:
        s.sendall(f"PROOF {cn} {mac.hexdigest()}\n".encode() + payload)
    except ConnectionError:
        pass
    said, closed = read_to_end(s, time.monotonic() + PATIENCE_S, hello)
    s.close()
    return verdict(said, closed)


# ---- The attacks ---------------------------------------------------------------------------


class Report:
    def __init__(self):
        self.tried = self.refused = 0
        self.connections = 0
        self.lock = threading.Lock()

    def add(self, name, result, connections=1):
        ok, words = result
        with self.lock:
            self.tried += 1
            self.refused += 1 if ok else 0
            self.connections += connections
            print(f"attack {name}: {'refused' if ok else 'NOT REFUSED'} ({words})", flush=True)


def attack(report, name, fn, *args):
    try:
        report.add(name, fn(*args))
    except OSError as e:  # no server, or no challenge in time: the attack proves nothing
        report.add(name, (False, f"the attack could not be made: {e}"))


def run_requests(report, host, port, requests):
    for name, payload in requests.items():
        attack(report, name, bare, host, port, payload)
        for g in GUESSES:
            named = f"{name} after guessing the secret '{g}'"
            attack(report, named, guessed, host, port, g, payload)


def closed_by_server(s):
    """Whether the server closed non-blocking `s` (what it said meanwhile is read and dropped)."""
    try:
        while True:
            if not s.recv(65536):
                return True
    except BlockingIOError:
        return False
    except OSError:
        return True


def open_all(host, port, n):
    """`n` connections opened as fast as they go, non-blocking; those that could be made."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, n + 256)), hard))
    socks = []
    for _ in range(n):
        try:
            socks.append(connect(host, port, timeout=3.0))
            socks[-1].setblocking(False)
        except OSError:
            pass
    return socks


def slow_loris(host, port, n):
    """`n` connections that each send a proof one byte every 0.5 s and never end it: the server
    closes each at its deadline. Returns the attack's result."""
    opened = time.monotonic()
    socks = open_all(host, port, n)
    closed_at = {}
    payload = b"PROOF " + b"a" * 200  # a line that never ends within the handshake's length
    for i in range(int(PATIENCE_S / 0.5)):
        for k, s in enumerate(socks):
            if k in closed_at:
                continue
            try:
                s.send(payload[i % len(payload) : i % len(payload) + 1])
            except OSError:
                pass
            if closed_by_server(s):
                closed_at[k] = time.monotonic() - opened
        if len(closed_at) == len(socks):
            break
        time.sleep(0.5)
    for s in socks:
        s.close()
    spread = f"{min(closed_at.values()):.1f}-{max(closed_at.values()):.1f} s" if closed_at else "-"
    return len(closed_at) == n, f"{len(closed_at)} of {n} closed by the server after {spread}"


def await_flood(socks, n, start, opened):
    """Waits until the server closed every connection of a flood opened `opened` seconds after
    `start`. Refused when it did, and when it held at most MAX_WAITING of them open a moment
    after the last came (it closes the oldest past that). Returns the attack's result."""
    poller = select.poll()
    by_fd = {s.fileno(): s for s in socks}
    for fd in by_fd:
        poller.register(fd, select.POLLIN)
    open_fds = set(by_fd)
    held = None  # how many were open a moment after the last one opened
    while open_fds and time.monotonic() - start < opened + PATIENCE_S:
        for fd, _ in poller.poll(100):
            if closed_by_server(by_fd[fd]):
                poller.unregister(fd)
                open_fds.discard(fd)
        if held is None and time.monotonic() - start > opened + SETTLE_S:
            held = len(open_fds)
    took = time.monotonic() - start
    held = len(open_fds) if held is None else held
    for s in socks:
        s.close()
    return (
        not open_fds and len(socks) == n and held <= MAX_WAITING,
        f"{len(socks)} opened in {opened:.1f} s, {held} of them still open {SETTLE_S:.0f} s "
        f"later, {len(socks) - len(open_fds)} closed by the server within {took:.1f} s of the "
        "first",
    )


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("target", choices=["lighthouse", "rendezvous"])
    p.add_argument("address", help="HOST:PORT of the server")
    p.add_argument("--run-id", default="none", help="the elastic job's run id (a guess)")
    p.add_argument("--flood", type=int, default=4000, help="connections in the flood")
    p.add_argument("--slow", type=int, default=16, help="slow connections")
    a = p.parse_args()
    host, _, port = a.address.rpartition(":")
    port = int(port)
    report = Report()
    if a.target == "lighthouse":
        # A TCPStore client's first words are its VALIDATE.
        run_requests(report, host, port, lighthouse_requests(tcpstore, tcpstore("validate")))
        frames = lighthouse_requests(frame)
        run_requests(report, host, port, {f"{k} (store frames)": v for k, v in frames.items()})
    else:
        run_requests(report, host, port, rendezvous_requests(a.run_id))
    attack(report, "a handshake line too long", bare, host, port, b"PROOF " + b"f" * 4096)
    attack(report, "garbage", bare, host, port, os.urandom(4096))
    start = time.monotonic()
    flood = open_all(host, port, a.flood)
    opened = time.monotonic() - start
    # After the flood: as the newest of the waiting connections, the slow ones are not the
    # ones its excess closes, and each meets the deadline.
    slow = {}
    thread = threading.Thread(target=lambda: slow.update(r=slow_loris(host, port, a.slow)))
    thread.start()
    print("every attack sent", flush=True)
    flooded = await_flood(flood, a.flood, start, opened)
    report.add(f"flood: {a.flood} connections", flooded, len(flood))
    thread.join()
    report.add(f"slow: {a.slow} connections sending a proof a byte every 0.5 s", slow["r"], a.slow)
    print(
        f"attacks: {report.tried} tried, {report.refused} refused; "
        f"{report.connections} connections in all",
        flush=True,
    )
    return 0 if report.tried == report.refused else 1


if __name__ == "__main__":
    sys.exit(main())
