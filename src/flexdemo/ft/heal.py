"""How a joining replica group fetches a healthy peer's state: data, never code.

Each rank runs one small HTTP server (:class:`HealServer`) that serves its state for one step
while torchft allows it (a peer is healing from this group). It listens on the address the
group advertises, not on every interface. A joiner fetches the state with :func:`fetch` and
loads it with ``torch.load(weights_only=True)``: tensors and plain containers only, so a
payload that carries a pickled object is refused, never run.

With a run secret (:mod:`flexdemo.secret`) both sides authenticate:

* a request carries ``requester nonce MAC(step, requester, nonce)``; the server answers a
  request without a valid MAC, or with a nonce seen before, with 403 and nothing else;
* the answer carries ``MAC(step, nonce, sha256(payload))``; the joiner checks it before it
  reads one byte of the payload as data, so a group without the secret cannot serve a heal.

Either way the healed state must be of the step the quorum asked for: a peer that claims
another step is refused (:class:`HealRefusedError`).
"""

from __future__ import annotations

import hashlib
import io
import socket
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch

from ..secret import RunSecret
from ..store import listen_address

__all__ = ["HealRefusedError", "HealServer", "bind_address", "fetch"]

REQUEST_HEADER = "X-Flexdemo-Heal"
MAC_HEADER = "X-Flexdemo-Mac"
MAX_NONCES = 100_000
"""Request nonces a server remembers (a replayed request is refused); older ones are
forgotten beyond this many (a server lives for one run)."""


class HealRefusedError(RuntimeError):
    """A heal that this group refused: the peer's state is not signed with the run secret,
    holds something other than data, or is of another step than the quorum's."""


def bind_address(hostname: str) -> tuple[str, str | None]:
    """The address to bind for a group that advertises ``hostname``, and why it is every
    interface (``""``) where it is (None where it is not): the rule of
    :func:`flexdemo.store.listen_address`, which the group's store follows too."""
    target = listen_address(hostname)
    if isinstance(target, str):
        return "", target
    return str(target[1][0]), None


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 64


class _Server6(_Server):
    address_family = socket.AF_INET6


def _listen(host: str, handler: type[BaseHTTPRequestHandler]) -> _Server:
    """A server on ``host`` and a free port (``""``: every interface, IPv6 and IPv4 where
    the machine has IPv6)."""
    if host == "":
        try:
            return _Server6(("::", 0), handler)
        except OSError:
            return _Server(("", 0), handler)
    return (_Server6 if ":" in host else _Server)((host, 0), handler)


class HealServer:
    """Serves this rank's state for one step to healing peers (see the module's docstring).

    ``host``: the address to bind (``""``: every interface); ``advertise``: the host name in
    :meth:`address`; ``say``: where a refused request is named (once per requesting host)."""

    def __init__(self, host: str, advertise: str, secret: RunSecret | None, timeout: float,
                 verbose: bool = False, say: Callable[[str], None] | None = None) -> None:
        self.secret, self.timeout, self.advertise = secret, timeout, advertise
        self._say = say or (lambda text: print(f"flexdemo: {text}", file=sys.stderr,
                                               flush=True))
        self._cond = threading.Condition()
        self._step: int | None = None  # the step served; None: nothing is served
        self._state: Any = None
        self._payload: bytes | None = None  # serialised on the first request of a step
        self._readers = 0
        self._nonces: set[str] = set()
        self._refused: set[str] = set()
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                self.connection.settimeout(owner.timeout)
                owner._answer(self)

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                if verbose:
                    super().log_message(format, *args)

        try:
            self._server = _listen(host, Handler)
        except OSError as e:
            raise OSError(f"the heal server cannot listen on {host or 'every interface'} "
                          f"({e.strerror or e}); set FLEXDEMO_FT_HOSTNAME to this node's "
                          "address on the replica network") from None
        self.host = host
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True,
                                        name="flexdemo-heal-server")
        self._thread.start()

    # ------------------------------------------------------------------ serving side
    @property
    def port(self) -> int:
        return int(self._server.socket.getsockname()[1])

    def address(self) -> str:
        """The URL peers fetch from (the step and ``/full`` are appended)."""
        host = f"[{self.advertise}]" if ":" in self.advertise else self.advertise
        return f"http://{host}:{self.port}/checkpoint/"

    def serve(self, step: int, state: Any) -> None:
        """Serve ``state`` as step ``step`` until :meth:`stop_serving`."""
        with self._cond:
            self._step, self._state, self._payload = step, state, None
            self._cond.notify_all()

    def stop_serving(self) -> None:
        """Serve nothing; returns once no request is reading the state any more."""
        with self._cond:
            self._step, self._state, self._payload = None, None, None
            while self._readers:
                self._cond.wait()

    def shutdown(self, wait: bool = True) -> None:
        self.stop_serving()
        if wait:
            self._server.shutdown()
            self._thread.join()
        else:  # stop the loop without waiting for it
            threading.Thread(target=self._server.shutdown, daemon=True).start()
        self._server.server_close()

    def _refuse(self, handler: BaseHTTPRequestHandler, code: int, why: str) -> None:
        peer = handler.client_address[0]
        if code == 403 and peer not in self._refused:
            self._refused.add(peer)
            self._say(f"the heal server refused a request from {peer}: {why}")
        handler.send_response(code)
        handler.send_header("Content-Length", "0")
        handler.end_headers()

    def _answer(self, handler: BaseHTTPRequestHandler) -> None:
        parts = handler.path.split("/")
        if len(parts) != 4 or parts[1] != "checkpoint" or parts[3] != "full" \
                or not parts[2].isdigit():
            return self._refuse(handler, 404, "unknown path")
        step = int(parts[2])
        nonce = ""
        if self.secret is not None:
            fields = handler.headers.get(REQUEST_HEADER, "").split()
            if len(fields) != 3:
                return self._refuse(handler, 403, "it carries no MAC of the run secret")
            requester, nonce, mac = fields
            if not self.secret.verify(mac, "heal-request", step, requester, nonce):
                return self._refuse(handler, 403, "its MAC does not verify under the run "
                                                  "secret")
            with self._cond:
                if nonce in self._nonces:
                    return self._refuse(handler, 403, "it replays an earlier request")
                if len(self._nonces) >= MAX_NONCES:
                    self._nonces.clear()
                self._nonces.add(nonce)
        with self._cond:  # a peer may ask before this group serves the step: wait for it
            self._cond.wait_for(lambda: self._step == step, timeout=self.timeout)
            if self._step != step:
                served = self._step
                payload = None
            else:
                served = step
                if self._payload is None:
                    buf = io.BytesIO()
                    torch.save(self._state, buf)
                    self._payload = buf.getvalue()
                payload = self._payload
                self._readers += 1
        if payload is None:
            return self._refuse(handler, 409, f"step {step} is not served (serving {served})")
        try:
            handler.send_response(200)
            handler.send_header("Content-Type", "application/octet-stream")
            handler.send_header("Content-Length", str(len(payload)))
            if self.secret is not None:
                digest = hashlib.sha256(payload).hexdigest()
                handler.send_header(MAC_HEADER, self.secret.mac("heal-state", step, nonce,
                                                                digest))
            handler.end_headers()
            handler.wfile.write(payload)
        finally:
            with self._cond:
                self._readers -= 1
                self._cond.notify_all()


# ---------------------------------------------------------------------- fetching side
def fetch(url: str, step: int, requester: str, secret: RunSecret | None,
          timeout: float) -> Any:
    """The state a peer serves at ``url`` for ``step``, checked (see the module's docstring);
    :class:`HealRefusedError` (one line naming the peer) when it fails a check."""
    nonce = RunSecret.nonce()
    request = urllib.request.Request(f"{url}{step}/full")
    if secret is not None:
        mac = secret.mac("heal-request", step, requester, nonce)
        request.add_header(REQUEST_HEADER, f"{requester} {nonce} {mac}")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            payload = answer.read()
            signature = answer.headers.get(MAC_HEADER, "")
    except urllib.error.HTTPError as e:
        why = ("it refused this group's MAC: its run secret differs (FLEXDEMO_SECRET)"
               if e.code == 403 else f"HTTP {e.code}")
        raise HealRefusedError(f"the heal source at {url} did not serve step {step}: "
                               f"{why}") from None
    if secret is not None:
        digest = hashlib.sha256(payload).hexdigest()
        if not secret.verify(signature, "heal-state", step, nonce, digest):
            raise HealRefusedError(
                f"the state served at {url} for step {step} is not signed with the run "
                "secret: refused, not loaded (a process outside the run, or a node with "
                "another FLEXDEMO_SECRET)")
    try:
        state = torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
    except Exception as e:  # UnpicklingError (a type that is not data), a truncated file
        first = next((x for x in str(e).splitlines() if x.strip()), type(e).__name__)
        raise HealRefusedError(f"the state served at {url} for step {step} is not plain "
                               f"tensors and containers: refused, not run ({first.strip()})"
                               ) from None
    claimed = state.get("torchft", {}).get("step") if isinstance(state, dict) else None
    if claimed != step:
        raise HealRefusedError(f"the state served at {url} is of step {claimed!r}, the quorum "
                               f"asked for step {step}: refused")
    return state
