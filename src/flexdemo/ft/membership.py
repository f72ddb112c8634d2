"""Who may be a member of a fault-tolerant run's quorum: the groups that know the run secret.

torchft's lighthouse admits any process that sends it a replica id. With a run secret each
group hands torchft the replica id ``name:nonce.MAC(name, nonce)`` (torchft appends
``:uuid``), and every group checks every member of every quorum before torchft acts on it
(reconfigures the process group, heals from a peer): a member without a valid tag, or with a
tag that another member also carries (a copy), stops the run on every honest group with one
line naming it (:class:`UntrustedPeerError`). The name stays first, so torchft orders the
groups and numbers their ranks as without a secret.

A tag is visible to anyone who reads the lighthouse's page, so a tag alone does not prove
the secret: when a quorum forms, before its process group meets, every member also writes a
MAC over that quorum's own store prefix (new for every quorum) and checks everyone else's
(:func:`prove_members`). A process that replays a tag it saw cannot write it.
"""

from __future__ import annotations

import re

from ..secret import RunSecret

__all__ = ["UntrustedPeerError", "check_members", "display_id", "prove_members", "split_id",
           "tag_replica_id"]

_TAG = re.compile(r"^[0-9a-f]{16}\.[0-9a-f]{32}$")
_SHOWN = re.compile(r":[0-9a-f]{16}\.[0-9a-f]{32}")


class UntrustedPeerError(RuntimeError):
    """A member of the quorum, or a heal source, that does not prove the run secret: this
    group stops rather than count it, heal from it or exchange with it."""


def tag_replica_id(name: str, secret: RunSecret | None) -> str:
    """The replica id this group hands torchft: ``name``, tagged where there is a secret."""
    if secret is None:
        return name
    nonce = RunSecret.nonce()
    return f"{name}:{nonce}.{secret.mac('replica', name, nonce)}"


def split_id(replica_id: str) -> tuple[str, str | None]:
    """``(name, tag)`` of a replica id as torchft lists it (``name[:tag]:uuid``)."""
    parts = replica_id.split(":")
    tag = parts[1] if len(parts) == 3 else None
    return parts[0], tag


def display_id(text: str) -> str:
    """``text`` without the membership tags of the replica ids in it."""
    return _SHOWN.sub("", text)


def check_members(replica_ids: list[str], secret: RunSecret | None, me: str,
                  lighthouse: str) -> None:
    """Raise :class:`UntrustedPeerError` (one line naming them) when a member of the quorum
    ``replica_ids`` lacks a valid tag under ``secret``, or carries another member's tag.
    Nothing to check without a secret (an open run)."""
    if secret is None:
        return
    bad, seen, copied = [], set(), []
    for rid in replica_ids:
        name, tag = split_id(rid)
        if tag is None or not _TAG.match(tag):
            bad.append(name)
            continue
        nonce, mac = tag.split(".")
        if not secret.verify(mac, "replica", name, nonce):
            bad.append(name)
        elif tag in seen:
            copied.append(name)
        seen.add(tag)
    if bad:
        names = ", ".join(repr(n) for n in bad)
        raise UntrustedPeerError(
            f"replica group {me!r}: the quorum at {lighthouse} holds replica group(s) {names} "
            "without the run secret's tag: not counted, not healed from; this group stops "
            "(an intruder, or a node with another FLEXDEMO_SECRET: give every node the same "
            "secret and keep the lighthouse off open networks, docs/security.md)")
    if copied:
        names = ", ".join(repr(n) for n in copied)
        raise UntrustedPeerError(
            f"replica group {me!r}: the quorum at {lighthouse} holds two members with the "
            f"tag of replica group(s) {names}: one copied the other's (an intruder replaying "
            "an id it saw); this group stops (docs/security.md)")


def prove_members(store, secret: RunSecret, tagged: str, scope: str, rank: int, world: int,
                  replica_ids: list[str], me: str) -> None:
    """Prove the secret to the other members of a new quorum and check their proofs, through
    ``store`` (a client of the quorum's store, under a prefix of its own). ``tagged``: this
    group's tagged id; ``scope``: the quorum's store prefix (it names the quorum, its step
    and its members); ``rank`` of ``world``: this member's place. Raises
    :class:`UntrustedPeerError` naming the members whose proof is missing or false (a member
    that never writes one is waited for as long as the store's timeout)."""
    store.set(str(rank), f"{tagged} {secret.mac('quorum-proof', scope, tagged)}")
    expected = {tag: name for name, tag in map(split_id, replica_ids)}
    proven: set[str | None] = {split_id(tagged + ":")[1]}
    for r in range(world):
        if r == rank:
            continue
        try:
            claim, _, mac = store.get(str(r)).decode().partition(" ")
        except Exception:  # never written within the timeout: the member has no proof
            continue
        name, tag = split_id(claim + ":")
        if tag in expected and secret.verify(mac, "quorum-proof", scope, claim):
            proven.add(tag)
    missing = [name for tag, name in expected.items() if tag not in proven]
    if missing:
        names = ", ".join(repr(n) for n in missing)
        raise UntrustedPeerError(
            f"replica group {me!r}: replica group(s) {names} of the quorum carry a valid tag "
            "but did not prove the run secret for this quorum: a copied id (an intruder "
            "replaying a tag it saw on the lighthouse's page); this group stops "
            "(docs/security.md)")
