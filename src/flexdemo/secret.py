"""The run secret: one key that every process of a run knows and no outsider does.

On an open network anyone who reaches a port can talk to a run's servers. With a secret
(``FLEXDEMO_SECRET``, ``FaultTolerance(secret=...)``, ``[fault_tolerance] secret``) each
exchange outside the training collectives carries an HMAC-SHA256 under it: a replica group's
membership tag, a heal request and the healed state, a start-up verdict. A message whose MAC
does not verify is refused. Every MAC names its purpose, so one of one kind never passes for
another (docs/security.md).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets

__all__ = ["MIN_SECRET_CHARS", "SECRET_ENV", "RunSecret", "SecretError", "resolve_secret"]

SECRET_ENV = "FLEXDEMO_SECRET"
MIN_SECRET_CHARS = 16
"""The shortest secret accepted: 16 characters (``secrets.token_hex(16)`` gives 32)."""
MAC_HEX = 32
"""Hex digits of a MAC as sent: 128 of HMAC-SHA256's 256 bits."""


class SecretError(ValueError):
    """A run secret that is unusable (too short); one line naming the fix."""


class RunSecret:
    """HMACs under a run's secret. Never printed: ``repr`` shows a fingerprint only."""

    def __init__(self, secret: str | bytes, source: str = "secret") -> None:
        raw = secret.encode() if isinstance(secret, str) else bytes(secret)
        if len(raw.strip()) < MIN_SECRET_CHARS:
            raise SecretError(
                f"{source} has {len(raw.strip())} characters; a run secret needs at least "
                f"{MIN_SECRET_CHARS}: make one with python -c 'import secrets; "
                "print(secrets.token_hex(16))' and give every node the same")
        self._key = hashlib.sha256(b"flexdemo run secret\0" + raw.strip()).digest()
        self.source = source

    @property
    def fingerprint(self) -> str:
        """Eight hex digits that tell two secrets apart without revealing either."""
        return hmac.new(self._key, b"fingerprint", hashlib.sha256).hexdigest()[:8]

    def __repr__(self) -> str:
        return f"RunSecret(fingerprint={self.fingerprint})"

    def mac(self, purpose: str, *parts: object) -> str:
        """The MAC of ``parts`` for ``purpose`` (hex, :data:`MAC_HEX` digits)."""
        message = json.dumps([purpose, *[str(p) for p in parts]], separators=(",", ":"))
        return hmac.new(self._key, message.encode(), hashlib.sha256).hexdigest()[:MAC_HEX]

    def verify(self, tag: str, purpose: str, *parts: object) -> bool:
        """Whether ``tag`` is :meth:`mac` of ``parts`` for ``purpose`` (constant time)."""
        if not isinstance(tag, str) or len(tag) != MAC_HEX:
            return False
        return hmac.compare_digest(tag, self.mac(purpose, *parts))

    def sign(self, purpose: str, text: str) -> str:
        """``text`` with its MAC appended (``text`` + ``"|mac="`` + MAC)."""
        return f"{text}|mac={self.mac(purpose, text)}"

    def open(self, purpose: str, signed: str) -> str | None:
        """The text of a :meth:`sign` ed message, or None when its MAC does not verify."""
        text, sep, tag = signed.rpartition("|mac=")
        if not sep or not self.verify(tag, purpose, text):
            return None
        return text

    def scope(self, prefix: str) -> str:
        """Where a store's keys under ``prefix`` live with this secret: one level below it,
        named by the secret (an outsider who writes to the plain keys reaches no rank)."""
        return f"{prefix}{self.mac('store-scope', prefix)[:16]}/"

    @staticmethod
    def nonce() -> str:
        """A fresh random nonce (16 hex digits)."""
        return secrets.token_hex(8)


def resolve_secret(given: str | RunSecret | None = None) -> RunSecret | None:
    """The run's secret: ``given``, else ``$FLEXDEMO_SECRET``, else None (an open run).
    Raises :class:`SecretError` (one line) for one that is too short."""
    if isinstance(given, RunSecret):
        return given
    if given is not None and str(given).strip():
        return RunSecret(given, "the secret")
    raw = os.environ.get(SECRET_ENV, "")
    if raw.strip():
        return RunSecret(raw, SECRET_ENV)
    return None
