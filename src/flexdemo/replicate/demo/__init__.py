"""DeMo: decoupled momentum, replicated as the top-k DCT coefficients of each block.

Per tensor and step: ``delta = decay * delta + s * grad`` (``s`` is the learning rate when
``scale_by_lr``, else 1); take the blocked orthonormal DCT of ``delta``; keep the ``topk``
largest-magnitude coefficients of every block; subtract what is sent (as the peers will decode
it) from ``delta`` (error feedback); all-gather the (index, value) pairs of all tensors in one
bucket; decode the true mean over the replicas (sum in replica order, divided by the number of
contributions: every replica computes the same bits); optionally apply ``sign()``.
``mean="senders"`` divides each coefficient by the number of replicas that sent it a non-zero
value rather than by all of them (what one replica alone sends is then not diluted), and
``clip="median"`` first scales every replica's payload down to the median of the replicas'
norms (an outsized update weighs no more than a typical one); both are decided on the device,
the same bits on every replica.
``transform="none"`` keeps the blocks but skips the DCT: plain per-block top-k.
``transform_dtype="bf16"`` runs the forward transform's products in bf16 (about 2^-8 relative
error per coefficient, several times faster where the hardware has bf16 products); the
momentum, the values and the inverse transform stay fp32.

The DCT is linear and orthonormal, so where the blocks tile the tensor exactly ``delta`` is kept
in the transform domain: the momentum update is fused into the forward transform and error
feedback subtracts coefficients, with no inverse transform. Tensors that need padding keep
``delta`` in the parameter's own domain, so the padding never holds momentum.

**Small tensors.** With ``small="batch"`` (default) every 1-D tensor and every tensor with
fewer than ``small_numel`` entries (default ``chunk * chunk``) is concatenated, in parameter
order, into one vector viewed as ``(rows, chunk)`` and compressed as one matrix: the same
``topk`` of ``chunk x chunk`` density as the large weights, instead of ``topk`` of ``chunk``
per 1-D chunk (at the defaults 32 of 64: more bytes than dense fp32). ``small="separate"``
compresses each tensor on its own.

**Groups: one batch of blocks per block shape.** Tensors whose blocks have the same shape (and
so the same ``k``) form a group. Every stage of a step runs once per group on all of its
blocks together: the gradients are staged into one image buffer per group (one multi-tensor
copy for the whole model), gathered into block layout by a row index built at set-up, both
DCT products run as batched matrix products, then top-k, value coding, bit packing, error
feedback, the checks of received payloads, the decoded mean, ``sign()`` and the write into the
gradients (one multi-tensor copy). The ops a step dispatches grow with the number of groups,
not of tensors. Everything works block by block, so the bits are those of coding each tensor
alone (``bucket=False``).

**Host synchronisation.** The checks of the received payloads (header, index range, repeated
indices, finite values, the non-finite flag and the presence code) run on the device and are
reduced to one small tensor, read once per step. In ``overlap="delayed"`` mode a step reads
nothing: the payloads it applies are checked on the device, bad peers are left out of the mean
there (a payload with the non-finite flag zeroes the update), and the verdict goes to host
memory without waiting; the next step judges it first (raises, or counts and warns), and a
checkpoint carries it. The non-finite flag
of this rank's own input is found on the device before the momentum update (the least and
largest entry of its staged input, one reduction per staging buffer); where it is set, the
staged input is zeroed, the decay factor is 1 and the selected values are sent as zeros, so
that rank's momentum stays bitwise untouched without a copy of it or a read of the flag. (A
momentum that overflows to Inf from finite input sends non-finite values: every replica's
payload check names that rank, as for any corrupt payload.)

**CUDA graphs** (``graphs="auto"``, the default: on CUDA unless ``compile=True``; ``True``;
``False``; no effect on other devices). The device work
between the host's decisions is captured once per step shape (which gradients are present,
which step sizes are equal) and replayed: encoding (flag, momentum, transform, selection,
coding, error feedback, header), the checks of the gathered payloads, and each group's decoded
mean. Staging the gradients, the exchange, the read of the verdict (delayed: its copy to
the host) and the writes into the gradients stay eager (their addresses change between
steps). The step number and the step
sizes are device scalars filled before a replay; a step size then scales the column basis of
the transform rather than its product, so the coefficients can differ from eager CUDA in the
last bit, identically on every replica. The first two steps of a shape run eagerly, the third
captures (the warm-up steps already use the device scalars, so a resumed run has the bits of
an uninterrupted one). A failed capture warns and the replicator stays eager. Every replica
must use the same setting. :class:`~flexdemo.SimulatedReplicas` turns ``"auto"`` off (its
replicas share one stream from several threads, which a capture cannot).

**Wire format** (one bucket per step): a 32-byte header (magic and version, step, non-finite
flag, presence code); then per group the block-local indices of all its blocks packed at
``ceil(log2(block entries))`` bits (12 for 64 x 64 blocks) and their values in the ``values``
format of :class:`~flexdemo.compress.blocks.BlockValueCodec` (``fp32``, ``bf16``, ``fp16``,
``int8`` with a scale per block, ``int2``, or ``sign`` with a magnitude per block), each
segment 8-byte aligned. :meth:`payload_bytes` is the exact size.

**Collectives.** ``bucket=True``: one all-gather per step; ``False``: every tensor is its own
group and has its own all-gather, plus one for the header (for comparison).
``reduce="scatter"`` replaces the all-gather, whose bytes per rank grow as ``n - 1``
payloads, by a reduce-scatter over block owners (:mod:`.scatter`): each rank sends the part of
its selection in the blocks that rank ``c`` owns to ``c`` (one all-to-all), each owner takes
the mean of its blocks (as ``mean`` says), keeps its top ``topk`` per block and codes it
again, and the owners' parts are all-gathered: about two payloads per rank whatever the group
size, for a second selection whose drop is not fed back (no owner-side state).
``reduce="shared"`` (:mod:`.shared`) sends every rank's values at one shared index set: each
rank picks the top ``ceil(topk / n)`` of every block, the index lists are all-gathered, every
rank codes its values at all the shared indices (error feedback subtracts exactly those) and
the values are averaged by block owners (all-to-all, the owner's mean coded again, all-gather):
no second selection, and bytes per rank flat in the group size.
``overlap="delayed"`` launches each step's all-gather asynchronously and applies it one step
later, so the exchange runs behind the next forward and backward: the update applied at step
``t`` is the replicas' mean of what they sent at step ``t - 1`` (zero at step 0). Default
``"none"``: the update of step ``t`` is applied at ``t``.

**Untrusted payloads.** Every received payload is checked: header (magic, version, step),
indices in range and unique within a block, values finite. A bad payload raises
:class:`CorruptPayloadError` naming the sending rank (``on_bad_peer="raise"``, default), or
with ``on_bad_peer="drop"`` that peer's contribution is left out of the step's mean on every
replica, with a warning and the counter ``dropped_payloads`` (in delayed mode both come one
step after the payload is applied without it). ``peer_bound`` (default 8; None: off) bounds
each peer's part (:mod:`~flexdemo.replicate.bound`): a peer whose values' norm is over 8 times
the median of the peers' norms (with 2 replicas: of this replica's own) is scaled down to that
median (own norm) before the mean; its norm rides in the verdict's read, so honest steps keep
their bits and read the device no more (delayed mode: decided on the device, reported with
the deferred verdict; ``reduce="scatter"``/``"shared"``: by the block owners, and every rank
bounds each owner's part by what it sent that owner).

**Modules** (one job each): :mod:`.settings` the presets and the checks of the settings;
:mod:`.layout` units, groups of blocks, staging and output views, payload offsets;
:mod:`.staging` the step's plan and the copies in and out; :mod:`.graphs` CUDA graphs and the
compiled selection; :mod:`.checks` the checks of received payloads and the delayed verdict;
:mod:`.decode` the inverse transform and the peers' mean; :mod:`.scatter` the
reduce-scatter by block owners; :mod:`.shared` the mean over one shared index set;
:mod:`.state` checkpoints;
:mod:`.replicator` :class:`DeMoReplicator`, whose :meth:`~DeMoReplicator.replicate` is the
algorithm.
"""

from .replicator import DeMoReplicator
from .settings import PRESETS

__all__ = ["PRESETS", "DeMoReplicator"]
