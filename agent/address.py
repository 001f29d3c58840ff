"""Which address other nodes use to reach this one.

A node's agent publishes an address in its node key; the leader's TCPStore and the embedded etcd
members listen on it. It must be an IP address that the other nodes can reach (etcd refuses a
host name as a listen address), so it is found in this order::

    --local-addr given        that address (a host name is resolved to its first IPv4/IPv6 address)
    this host's name          resolved; used when the result is not a loopback address
    the route to a peer       the source address the kernel picks for a packet to another node of
                              the job (no packet is sent: a UDP socket is only connected)
    nothing found             ConfigError naming what was tried; pass --local-addr

The loopback check matters on Debian-style hosts whose ``/etc/hosts`` maps the host name to
127.0.1.1: etcd would then listen where no other node can reach it.
"""

from __future__ import annotations

import ipaddress
import socket
from typing import Callable, Iterable

from agent.errors import ConfigError

Resolver = Callable[[str], list[str]]


def resolve(host: str) -> list[str]:
    """Every address ``host`` resolves to (IPv4 first), without duplicates; [] when it does not."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        return []
    found: list[str] = []
    for family in (socket.AF_INET, socket.AF_INET6):
        for fam, _, _, _, sockaddr in infos:
            address = str(sockaddr[0]).split("%", 1)[0]
            if fam == family and address not in found:
                found.append(address)
    return found


def is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def source_address_towards(peer: str) -> str | None:
    """The local address the kernel would send from to reach ``peer`` (an IP), or None."""
    family = socket.AF_INET6 if ":" in peer else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as sock:
            sock.connect((peer, 9))  # UDP connect: a route lookup, nothing is sent
            return str(sock.getsockname()[0])
    except OSError:
        return None


def node_address(hostname: str, peers: Iterable[str] = (), override: str | None = None,
                 resolver: Resolver = resolve,
                 towards: Callable[[str], str | None] = source_address_towards) -> str:
    """This node's IP address for the other nodes of the job (see the module docstring)."""
    if override:
        if _is_ip(override):
            return override
        found = resolver(override)
        if not found:
            raise ConfigError(f"--local-addr {override!r} does not resolve to an address")
        return found[0]
    if _is_ip(hostname):
        return hostname
    own = [a for a in resolver(hostname) if not is_loopback(a)]
    if own:
        return own[0]
    for peer in peers:
        if peer == hostname:
            continue
        for address in resolver(peer):
            if is_loopback(address):
                continue
            source = towards(address)
            if source and not is_loopback(source):
                return source
    raise ConfigError(f"cannot find an address of this node that other nodes can reach: {hostname!r} resolves "
                      f"to no non-loopback address and no route to another node was found; pass --local-addr")


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
        return True
    except ValueError:
        return False


def format_endpoint(host: str, port: int) -> str:
    """``host:port``, with brackets around an IPv6 address."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
