"""Stage 3: every rank must run the same units in the same order, because each unit's
all-gathers and reduce-scatters are matched by order. ``UnitAgreement`` checks it without
making the ranks wait for each other at every unit.

Each unit call of a forward (and its end) is *announced*: a tiny all-gather of the unit's
index, left in flight. The announcements are *settled* (waited for, and compared) only
where a rank would otherwise risk waiting forever on a collective that another rank may
never issue:

* before a collective that does not follow from the recorded plan (the first forward, a
  unit off the plan, a unit that was not prefetched): every announcement so far;
* before waiting for a prefetched unit: the announcements made up to its prefetch (every
  rank that agreed up to there issued that prefetch too);
* at the end of the forward: every announcement (one wait per step instead of one per unit).

``GatheredParameters`` that needs a collective (a gather, or a wait for a prefetch) announces
itself and settles at once (``meet``), so a rank that took another branch before it gets the
same error instead of a collective its peers never join.

When ranks disagree, every rank raises the same error naming what each ran. A rank that kept
to the plan may by then have started prefetches the others never start, so the process
group is not fit for more collectives after this error (as after any collective error).
"""
from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Callable, Optional

if TYPE_CHECKING:
    from .collectives import Comm, PendingInts

END_OF_FORWARD = -1
GATHERED_PARAMETERS = -2
_MOST_IN_FLIGHT = 64


class UnitAgreement:
    """The announcements of one engine's units; ``name(index)`` names a unit in errors."""

    def __init__(self, comm: "Comm", name: Callable[[int], str],
                 hint: Callable[[list[int]], str] = lambda seen: "") -> None:
        self.comm, self.name, self.hint = comm, name, hint  # hint: a remedy for ranks that ran these
        self.announced = 0  # announcements made so far (their sequence numbers are 1, 2, ...)
        self.meetings = 0   # settles that waited for the newest announcement: the ranks met at this call
        self._pending: deque[tuple[int, "PendingInts"]] = deque()

    def announce(self, index: int) -> None:
        """This rank is about to run unit ``index`` (or ``END_OF_FORWARD``)."""
        if self.comm.world_size == 1:
            return
        self.announced += 1
        self._pending.append((self.announced, self.comm.all_gather_ints([index], async_op=True)))
        if len(self._pending) > _MOST_IN_FLIGHT:  # units called outside a model's forward: no end to settle at
            self.settle(self.announced - _MOST_IN_FLIGHT)

    def meet(self, index: int) -> None:
        """Announce ``index`` and settle every announcement: the ranks agree here, now."""
        self.announce(index)
        self.settle()

    def settle(self, upto: Optional[int] = None) -> None:
        """Wait for the announcements up to number ``upto`` (all by default) and raise, on
        every rank, if the ranks ran different units at any of them."""
        if self._pending and (upto is None or upto >= self.announced):
            self.meetings += 1
        while self._pending and (upto is None or self._pending[0][0] <= upto):
            _, pending = self._pending.popleft()
            seen = [v[0] for v in pending.result()]
            if len(set(seen)) > 1:
                self._pending.clear()
                raise RuntimeError(
                    "stage 3 needs every rank to run the same modules in the same order, but "
                    + "; ".join(f"rank {r} {self._what(i)}" for r, i in enumerate(seen))
                    + "." + self.hint(seen)
                    + " Make the branch the same on every rank (e.g. run both and mask), or put the modules "
                    "that may be skipped inside a unit that always runs "
                    "(raise stage3_param_persistence_threshold), or use stage 2.")

    def abandon(self) -> None:
        """Drop the announcements in flight without waiting for them: this rank's forward
        raised, so its peers may never make the matching ones."""
        self._pending.clear()

    def _what(self, index: int) -> str:
        if index == END_OF_FORWARD:
            return "ended its forward"
        if index == GATHERED_PARAMETERS:
            return "entered GatheredParameters"
        return f"ran unit {index} ({self.name(index)})"
