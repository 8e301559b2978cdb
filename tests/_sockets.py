"""The listening TCP sockets of a process tree, read from /proc (Linux only)."""

from __future__ import annotations

import ipaddress
import os


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(d))
    return kids


def process_tree(root: int) -> list[int]:
    """``root`` and every process descended from it."""
    kids, out = _children(), [root]
    for pid in out:
        out.extend(kids.get(pid, []))
    return out


def _socket_inodes(pid: int) -> set[int]:
    found = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return found
    for fd in fds:
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            found.add(int(link[8:-1]))
    return found


def _address(hex_addr: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """An address of /proc/net/tcp* (32-bit words in host, little-endian, order)."""
    raw = bytes.fromhex(hex_addr)
    raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return ipaddress.ip_address(raw)


def _listening() -> dict[int, tuple[str, int]]:
    """inode -> (address, port) of every listening TCP socket of the machine."""
    out = {}
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(name) as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == "0A":  # TCP_LISTEN
                addr, port = fields[1].split(":")
                out[int(fields[9])] = (str(_address(addr)), int(port, 16))
    return out


def is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    mapped = getattr(ip, "ipv4_mapped", None)
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)


def listening_sockets(root: int) -> list[tuple[int, str, str, int]]:
    """``(pid, command, address, port)`` of each listening TCP socket of ``root``'s tree."""
    table, out = _listening(), []
    for pid in process_tree(root):
        try:
            with open(f"/proc/{pid}/cmdline") as f:
                cmd = f.read().replace("\0", " ").strip()[:120]
        except OSError:
            continue
        for inode in _socket_inodes(pid):
            if inode in table:
                out.append((pid, cmd, *table[inode]))
    return out
