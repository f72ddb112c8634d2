"""Hosting a TCPStore on the address it is given. torch's TCPStore server listens on every
interface whatever its ``host_name`` says, but it takes a socket that is already bound and
listening (``master_listen_fd``): :func:`host_store` binds one to the given address, so the
store listens there only (docs/security.md). Where that would cut off the peers, or cannot
be done, it hosts the store as torch does and says why."""

from __future__ import annotations

import errno
import ipaddress
import os
import socket
from datetime import timedelta
from typing import Any

import torch.distributed as dist

__all__ = ["host_store", "listen_address"]

_CANNOT_BIND = (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT)
"""Errors of ``bind`` that mean the address is not this machine's (or its family is off)."""


def listen_address(addr: str) -> tuple[socket.AddressFamily, tuple[Any, ...]] | str:
    """Where a server that peers reach at ``addr`` can listen: its family and socket address
    (port 0), else why not: ``addr`` does not resolve here, or it is a host name that
    resolves here to loopback (Debian's ``127.0.1.1`` for the machine's own name) while peers
    on other machines resolve it elsewhere. A loopback literal and ``localhost`` are loopback
    for every peer: they are bound."""
    host = addr.strip().strip("[]")
    try:
        ipaddress.ip_address(host.partition("%")[0])
        literal = True
    except ValueError:
        literal = False
    try:
        infos = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return f"{addr!r} does not resolve here"
    family, _, _, _, sockaddr = infos[0]
    address = str(sockaddr[0])
    name = host.lower().rstrip(".")
    if (not literal and name != "localhost" and not name.endswith(".localhost")
            and ipaddress.ip_address(address.partition("%")[0]).is_loopback):
        return f"{addr!r} resolves here to loopback ({address})"
    return socket.AddressFamily(family), tuple(sockaddr)


def host_store(addr: str, port: int, world: int | None = None,
               timeout: timedelta = timedelta(seconds=300), *, wait_for_workers: bool = True,
               multi_tenant: bool = False, use_libuv: bool = True
               ) -> tuple[dist.TCPStore, str | None]:
    """Host a TCPStore (``is_master``) that listens only on ``addr``'s address on this machine,
    port ``port`` (0: a free one, see the store's ``port``); the other arguments are
    ``dist.TCPStore``'s. Returns ``(store, None)``, or ``(store, why)`` where it listens on
    every interface as torch's own does: ``addr`` does not resolve here, resolves here to
    loopback while it is a host name that peers resolve elsewhere, or is no address of this
    machine. ``why`` reads e.g. ``'node1' resolves here to loopback (127.0.1.1)``. Where the
    port is taken, torch decides as it would (a multi-tenant store of this process on that
    port is shared; otherwise its error). torch owns the socket it is handed and closes it
    with the store."""
    target = listen_address(addr)
    listener, why = (None, target) if isinstance(target, str) else _bind(*target, port, addr)
    if listener is None:
        return dist.TCPStore(addr, port, world, True, timeout,
                             wait_for_workers=wait_for_workers, multi_tenant=multi_tenant,
                             use_libuv=use_libuv), why
    bound = listener.getsockname()[1]  # torch's other backend wants the port itself, not 0
    stat = os.fstat(listener.fileno())
    node = (stat.st_dev, stat.st_ino)
    fd = listener.detach()  # torch owns the descriptor from here and closes it with the store
    try:
        store = dist.TCPStore(addr.strip().strip("[]"), bound, world, True, timeout,
                              wait_for_workers=wait_for_workers, multi_tenant=multi_tenant,
                              master_listen_fd=fd, use_libuv=use_libuv)
    except BaseException:
        _close_if_left(fd, node)
        raise
    return store, None


def _bind(family: socket.AddressFamily, sockaddr: tuple[Any, ...], port: int, addr: str
          ) -> tuple[socket.socket | None, str | None]:
    """A socket bound to ``sockaddr`` with ``port`` and listening (SO_REUSEADDR, as torch's),
    or None and why not where the address is not this machine's (None, None: another error,
    such as a port in use, which torch then meets and reports as it does)."""
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((sockaddr[0], port, *sockaddr[2:]))
        listener.listen(socket.SOMAXCONN)
    except OSError as e:
        listener.close()
        if e.errno not in _CANNOT_BIND:
            return None, None
        what = (addr if sockaddr[0] == addr.strip().strip("[]")
                else f"{addr!r} (here {sockaddr[0]})")
        if e.errno == errno.EADDRNOTAVAIL:
            return None, f"{what} is no address of this machine"
        return None, f"{what} cannot be bound here ({e.strerror})"
    return listener, None


def _close_if_left(fd: int, node: tuple[int, int]) -> None:
    """After torch failed to start the store: close ``fd`` where torch left it open (it is
    still the listening socket, ``node``: its device and inode), never a descriptor that
    was reused since."""
    try:
        stat = os.fstat(fd)
        if (stat.st_dev, stat.st_ino) == node:
            os.close(fd)
    except OSError:  # torch closed it
        pass
