"""The tail rule of `prefix-freq`: are request tails one-time on this workload?"""

from __future__ import annotations

# Indexes into `TailEvidence.counts`.
EVICTED_TAIL, RETURNED_TAIL, EVICTED_NEW, RETURNED_NEW, HIT_TAIL, HIT_NEW = range(6)


class TailEvidence:
    """Departures of request tails and of other new blocks, and the rule they feed.

    A tail or new block leaves its segment either by a hit (touch) or by eviction, and an
    evicted one may return (re-stored from the ghost list). The owner counts these in `counts`
    (indexed by the constants above; a plain list so that hot loops add to it directly).
    """

    __slots__ = ("counts",)

    def __init__(self) -> None:
        self.counts = [0, 0, 0, 0, 0, 0]

    def one_time(self, reuse_max: float) -> bool:
        """Whether request tails are reused less than half as often as other new blocks, and by
        fewer than `reuse_max` of them (so that demoting them is right on this workload);
        false until 64 tails and 64 other new blocks have left (demoting tails on no evidence
        cost 2 hits at synthetic 40k, where exact repeats reuse them).

        Reuse rate = (hits + re-stores of evicted ones) / (hits + evictions). Counting resident
        hits, not only ghost returns, gives the evidence before the tier is under pressure."""
        te, tr, ne, nr, th, nh = self.counts
        if te + th < 64 or ne + nh < 64:
            return False
        reused, left = th + tr, th + te
        return reused * (nh + ne) < 0.5 * (nh + nr) * left and reused < reuse_max * left

    def clear(self) -> None:
        self.counts = [0, 0, 0, 0, 0, 0]
