"""Whether a peer runs on this host, and so shares its cores: a draft server and a target on one
machine must not both take all of its cores at once (docs/scheduler.md)."""

from __future__ import annotations

import ipaddress
import os
import socket
from urllib.parse import urlsplit


def on_this_host(address: str | None) -> bool:
    """Whether a peer's address (ZeroMQ's Peer-Address of its connection) belongs to this host:
    loopback, or an address of one of its own interfaces (one it can bind). A peer without one
    (ipc, inproc) is on this host too. A network namespace is a host of its own here, as its
    emulated hosts are meant to be."""
    if not address:
        return True
    try:
        ip = ipaddress.ip_address(address.split("%")[0])
    except ValueError:
        return False
    ip = getattr(ip, "ipv4_mapped", None) or ip
    if ip.is_loopback:
        return True
    with socket.socket(socket.AF_INET6 if ip.version == 6 else socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.bind((str(ip), 0))
            return True
        except OSError:
            return False


def zmq_host(address: str) -> str | None:
    """The host of a ZeroMQ address (tcp://host:port; None for ipc:// and inproc://)."""
    if not address.startswith("tcp://"):
        return None
    return urlsplit(address).hostname


def shares_cores(address: str, threads: int) -> bool:
    """Whether a process running `threads` compute threads would take cores from a draft server at
    `address` (or a draft server from it): the server is on this host and the threads are more than
    half of the cores this process may run on."""
    return server_on_this_host(address) and threads > len(os.sched_getaffinity(0)) // 2


def server_on_this_host(address: str) -> bool:
    """Whether the server at a ZeroMQ address (tcp://host:port, ipc://, inproc://) runs on this host."""
    host = zmq_host(address)
    if host is not None and not _is_ip(host):
        try:
            host = socket.gethostbyname(host)  # e.g. localhost
        except OSError:
            return False
    return on_this_host(host)


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False
