"""State kept in bf16, rounded stochastically: DeMo's momentum (``momentum_dtype="bf16"``) and
DiLoCo's global copy (``global_dtype="bf16"``).

Round-to-nearest would lose what a long-lived state adds in small steps: ``0.999 * m`` rounds
back to ``m`` in bf16 (8 bits of mantissa), so a momentum would stop decaying and a global copy
would ignore updates below half a unit in the last place. Stochastic rounding rounds up with
the probability of the distance to the lower neighbour, so the stored value is the fp32 value
in expectation (unbiased), at the cost of noise of at most one bf16 unit in the last place.

How: add 16 random bits to the fp32 bit pattern and keep its upper 16 bits (a bf16 is the
upper half of an fp32). The random bits come from a :class:`torch.Generator` seeded from a
key of integers (a step, a rank, a group), so the rounding is the same whenever the same
state is rounded at the same point of a run: a resumed run has the bits of an uninterrupted
one. They are drawn in chunks of at most :data:`CHUNK` entries into reused buffers (6 MiB).
"""

from __future__ import annotations

import torch

#: the stored dtypes of a state kept at lower precision, by setting
STATE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

#: the most entries rounded per pass (4 MiB of int32 scratch and 2 MiB of random draws)
CHUNK = 1 << 20

_MASK64 = (1 << 64) - 1


def seed_of(*key: int) -> int:
    """A 63-bit seed that mixes the integers of ``key`` (splitmix64 on each in turn): keys
    that differ in any place give unrelated seeds."""
    h = 0x9E3779B97F4A7C15
    for k in key:
        h = (h ^ (int(k) & _MASK64)) * 0xBF58476D1CE4E5B9 & _MASK64
        h = (h ^ (h >> 27)) * 0x94D049BB133111EB & _MASK64
        h ^= h >> 31
    return h >> 1


def check_state_dtype(setting: str, value) -> None:
    """Raise ValueError unless ``value`` names a stored dtype (:data:`STATE_DTYPES`)."""
    if value not in STATE_DTYPES:
        raise ValueError(f"{setting} must be one of {sorted(STATE_DTYPES)}, got {value!r}")


class StochasticRounding:
    """Rounds fp32 tensors into bf16 ones on one device, stochastically (see the module's
    docstring); its generator and scratch buffer are reused."""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.gen = torch.Generator(self.device)
        self.scratch = torch.empty(0, dtype=torch.int32, device=self.device)
        self.draws = torch.empty(0, dtype=torch.int64, device=self.device)

    def round_into(self, src: torch.Tensor, dst: torch.Tensor, *key: int) -> None:
        """``src`` (fp32) rounded stochastically into ``dst`` (bf16, contiguous, as many
        entries, on this device), with the random bits of ``key``; ``src`` is left as it
        was."""
        if src.dtype != torch.float32 or dst.dtype != torch.bfloat16:
            raise TypeError(f"stochastic rounding goes from float32 to bfloat16, not "
                            f"{src.dtype} to {dst.dtype}")
        n = src.numel()
        if dst.numel() != n or not dst.is_contiguous():
            raise ValueError(f"rounding {n} entries into a contiguous tensor of as many, not "
                             f"{tuple(dst.shape)} with strides {dst.stride()}")
        if n == 0:
            return
        self.gen.manual_seed(seed_of(*key))
        if self.scratch.numel() < min(n, CHUNK):
            self.scratch = torch.empty(min(n, CHUNK), dtype=torch.int32, device=self.device)
            self.draws = torch.empty(-(-self.scratch.numel() // 4), dtype=torch.int64,
                                     device=self.device)
        bits = src.contiguous().view(-1).view(torch.int32)
        out = dst.view(-1).view(torch.int16)
        for a in range(0, n, CHUNK):
            b = min(n, a + CHUNK)
            # 64 random bits per draw, four 16-bit values each (a quarter of the draws of one
            # bounded value per entry: the draws are most of the cost on a CPU)
            draws = self.draws[: -(-(b - a) // 4)].random_(-(1 << 63), None, generator=self.gen)
            r = self.scratch[: b - a]
            r.copy_(draws.view(torch.int16)[: b - a]).bitwise_and_(0xFFFF)  # in [0, 2^16)
            # the upper half of (bits + r): the lower neighbour, or the upper one with the
            # probability of the dropped lower half (an arithmetic shift keeps the sign bit,
            # so the result fits int16 exactly)
            out[a:b].copy_(r.add_(bits[a:b]).bitwise_right_shift_(16))
