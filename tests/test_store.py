"""The stores flexdemo hosts listen on the address they are given (security issue 54): real
sockets, read back from /proc/net/tcp*, and real clients."""

from __future__ import annotations

import ipaddress
import os
import socket
import subprocess
from datetime import timedelta

import pytest
import torch.distributed as dist

from flexdemo.join import join
from flexdemo.store import host_store
from flexdemo.tools.ranks import free_port

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/net/tcp"),
                                reason="reads the listening sockets from /proc/net/tcp")

SHORT = timedelta(seconds=20)


def _hex_address(text: str) -> str:
    """An address of /proc/net/tcp* (``0100007F``: 127.0.0.1, in the kernel's byte order)."""
    raw = bytes.fromhex(text)
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return str(ipaddress.ip_address(words))


def _listening(port: int) -> list[str]:
    """The addresses where this process's sockets listen on ``port``."""
    mine = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            mine.add(target[len("socket:["):-1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not os.path.exists(table):
            continue
        with open(table) as f:
            for line in f.read().splitlines()[1:]:
                cols = line.split()
                local, state, inode = cols[1], cols[3], cols[9]
                address, _, hex_port = local.rpartition(":")
                if state == "0A" and int(hex_port, 16) == port and inode in mine:
                    found.append(_hex_address(address))
    return found


def _other_local_address() -> str | None:
    """An IPv4 address of this machine besides loopback, if any (read from ``ip``: nothing
    is sent anywhere)."""
    try:
        out = subprocess.run(["ip", "-4", "-o", "addr", "show"], capture_output=True,
                             text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for line in out.splitlines():
        fields = line.split()
        if "inet" in fields:
            address = fields[fields.index("inet") + 1].partition("/")[0]
            if not ipaddress.ip_address(address).is_loopback:
                return address
    return None


def _refused(address: str, port: int) -> bool:
    try:
        with socket.create_connection((address, port), timeout=2):
            return False
    except OSError:
        return True


def _loopback_name() -> str | None:
    """A host name other than ``localhost`` that resolves here to loopback (the machine's own
    name on Debian and in many containers), if there is one."""
    for name in (socket.gethostname(), socket.getfqdn(), "ip6-localhost",
                 "localhost.localdomain"):
        if name.lower() == "localhost":
            continue
        try:
            address = socket.getaddrinfo(name, 0, type=socket.SOCK_STREAM)[0][4][0]
        except OSError:
            continue
        if ipaddress.ip_address(str(address).partition("%")[0]).is_loopback:
            return name
    return None


@pytest.mark.parametrize("use_libuv", [True, False], ids=["libuv", "classic"])
@pytest.mark.parametrize("fixed_port", [False, True], ids=["port0", "fixed"])
def test_store_on_loopback_listens_there_only(use_libuv, fixed_port):
    """Hosted on 127.0.0.1 the store listens on 127.0.0.1 alone (not 0.0.0.0 or ::), on the
    port it reports; clients connect there and see its keys."""
    port = free_port() if fixed_port else 0
    store, why = host_store("127.0.0.1", port, None, SHORT, wait_for_workers=False,
                            multi_tenant=True, use_libuv=use_libuv)
    assert why is None
    assert store.port > 0 and (not fixed_port or store.port == port)
    assert _listening(store.port) == ["127.0.0.1"]
    client = dist.TCPStore("127.0.0.1", store.port, None, False, SHORT)
    client.set("from-client", "1")
    store.set("from-host", "2")
    assert store.get("from-client") == b"1" and client.get("from-host") == b"2"


def test_store_on_ipv6_loopback_listens_there_only():
    try:
        socket.socket(socket.AF_INET6, socket.SOCK_STREAM).bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback here")
    store, why = host_store("::1", 0, None, SHORT, wait_for_workers=False)
    assert why is None and _listening(store.port) == ["::1"]
    client = dist.TCPStore("::1", store.port, None, False, SHORT)
    client.set("k", "v")
    assert store.get("k") == b"v"
    assert _refused("127.0.0.1", store.port)


def test_store_on_an_interface_address_listens_there_only():
    address = _other_local_address()
    if address is None:
        pytest.skip("this machine has no address besides loopback")
    # (no connection to it: tests send traffic to loopback only)
    store, why = host_store(address, 0, None, SHORT, wait_for_workers=False)
    assert why is None and _listening(store.port) == [address]
    assert _refused("127.0.0.1", store.port)


def test_stores_hosted_one_after_another_leave_no_socket_behind():
    """torch closes the socket it is handed with the store: none is left open, the port is
    free again, and a store that cannot start (its workers never come) leaves none either."""
    before = len(os.listdir("/proc/self/fd"))
    for use_libuv in (True, False):
        for _ in range(3):
            store, _ = host_store("127.0.0.1", 0, None, SHORT, wait_for_workers=False,
                                  use_libuv=use_libuv)
            port = store.port
            del store
            assert _listening(port) == []
        with pytest.raises(RuntimeError):  # DistStoreError: 1 of 2 workers in 1 s
            host_store("127.0.0.1", 0, 2, timedelta(seconds=1), use_libuv=use_libuv)
    assert len(os.listdir("/proc/self/fd")) <= before + 2  # torch's own pipe, made once


def test_multi_tenant_store_on_a_taken_port_is_shared():
    """A second multi-tenant store of this process on the same port shares the first's server
    (as torch's own), without a note."""
    first, _ = host_store("127.0.0.1", 0, None, SHORT, wait_for_workers=False,
                          multi_tenant=True)
    second, why = host_store("127.0.0.1", first.port, None, SHORT, wait_for_workers=False,
                             multi_tenant=True)
    first.set("k", "v")
    assert why is None and second.get("k") == b"v"


def test_host_name_that_resolves_here_to_loopback_listens_everywhere_and_says_why():
    name = _loopback_name()
    if name is None:
        pytest.skip("no host name here resolves to loopback besides localhost")
    store, why = host_store(name, 0, None, SHORT, wait_for_workers=False)
    assert why is not None and why.startswith(f"{name!r} resolves here to loopback (")
    assert set(_listening(store.port)) <= {"0.0.0.0", "::"} and _listening(store.port)
    dist.TCPStore(name, store.port, None, False, SHORT).set("k", "v")
    assert store.get("k") == b"v"


def test_localhost_is_bound_to_loopback():
    store, why = host_store("localhost", 0, None, SHORT, wait_for_workers=False)
    assert why is None
    assert all(ipaddress.ip_address(a).is_loopback for a in _listening(store.port))


def test_name_that_does_not_resolve_and_foreign_address_fall_back(monkeypatch):
    """Where the address cannot be bound, the store is torch's own (every interface), with
    the reason; here torch's store is stood in for, since its client could not reach it."""
    made = []

    class Recorder:
        def __init__(self, *args, **kwargs):
            made.append((args, kwargs))

    monkeypatch.setattr(dist, "TCPStore", Recorder)
    _, why = host_store("no-such-host.invalid", 0, None, SHORT)
    assert why == "'no-such-host.invalid' does not resolve here"
    _, why = host_store("203.0.113.7", 0, None, SHORT)  # TEST-NET-3: no machine's address
    assert why == "203.0.113.7 is no address of this machine"
    assert all("master_listen_fd" not in kwargs for _, kwargs in made) and len(made) == 2


def test_rank_zero_hosts_the_jobs_store_on_master_addr_only():
    """join(): rank 0 hosts the job's store on MASTER_ADDR alone (torchrun's agent aside)."""
    port = free_port()
    joined = join(0, 1, "127.0.0.1", port, SHORT, window=10.0)
    try:
        assert _listening(port) == ["127.0.0.1"]
    finally:
        joined.stop()


def test_rank_zero_says_when_the_jobs_store_listens_everywhere(capsys):
    name = _loopback_name()
    if name is None:
        pytest.skip("no host name here resolves to loopback besides localhost")
    port = free_port()
    joined = join(0, 1, name, port, SHORT, window=10.0)
    joined.stop()
    err = capsys.readouterr().err
    assert (f"flexdemo: the job's store (rank 0) listens on every interface, port {port}, "
            f"not only on MASTER_ADDR: {name!r} resolves here to loopback") in err
