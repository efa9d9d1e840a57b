"""The TCP sockets that processes listen on, read from /proc as `ss -ltnp` reads them: /proc/net/tcp{,6} give each
listening socket's address and inode, /proc/PID/fd links name the inodes each process holds."""
import ipaddress
import os
import socket
import struct
from pathlib import Path

LISTEN = "0A"  # the TCP state's code in /proc/net/tcp


def _address(hex_ip: str) -> str:
    raw = bytes.fromhex(hex_ip)
    if len(raw) == 4:
        return socket.inet_ntop(socket.AF_INET, struct.pack("<I", int(hex_ip, 16)))
    words = struct.unpack("<4I", raw)  # /proc/net/tcp6 prints each 32-bit word in host order
    ip = ipaddress.IPv6Address(struct.pack(">4I", *words))
    return str(ip.ipv4_mapped or ip)


def listening() -> dict[int, tuple[str, int]]:
    """{socket inode: (address, port)} of every listening TCP socket of this network namespace."""
    out = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == LISTEN:
                ip, port = fields[1].split(":")
                out[int(fields[9])] = (_address(ip), int(port, 16))
    return out


def listeners_of(pids) -> list[tuple[str, int, int, str]]:
    """(address, port, pid, command name) of each TCP socket that one of the processes listens on."""
    sockets, out = listening(), []
    for pid in pids:
        try:
            links = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
            name = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:  # the process ended meanwhile
            continue
        for link in links:
            inode = int(link[8:-1]) if link.startswith("socket:[") else None
            if inode in sockets:
                out.append((*sockets[inode], pid, name))
    return out


def session_of(pid: int) -> list[int]:
    """Every process in the session of pid (a daemon started with start_new_session and everything it spawned)."""
    sid = os.getsid(pid)
    mine = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.getsid(int(entry)) == sid:
                    mine.append(int(entry))
            except OSError:
                continue
    return mine


def pid_listening_on(port: int) -> int | None:
    """The process that listens on this TCP port, if any."""
    inodes = {inode for inode, (_, p) in listening().items() if p == port}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            if any(os.readlink(f"/proc/{entry}/fd/{fd}") in {f"socket:[{i}]" for i in inodes}
                   for fd in os.listdir(f"/proc/{entry}/fd")):
                return int(entry)
        except OSError:
            continue
    return None
