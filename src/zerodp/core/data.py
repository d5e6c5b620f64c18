"""The data loader ``zerodp.initialize(training_data=...)`` returns, and its position in a checkpoint.

Each rank draws micro-batches from a :class:`ResumableSampler`: the same shuffled order of the
whole dataset on every rank (seeded by ``seed`` and the epoch, like ``DistributedSampler``),
split by striding, rank ``r`` taking positions ``r, r + N, r + 2N, ...``. After ``B`` micro-batches
of ``m`` samples on each of ``N`` ranks the ranks together have consumed exactly the first
``B * m * N`` positions of that order, whatever ``N`` is. A checkpoint stores that count and
the epoch (:meth:`DataLoader.state_dict`), so a run resumed at any world size continues with the
next unseen sample of the same order; at the same world size every rank gets exactly the
batches it would have had without the interruption.
"""
from __future__ import annotations

from typing import Iterator, Optional

import torch
from torch.utils.data import Dataset, Sampler


class ResumableSampler(Sampler[int]):
    """``DistributedSampler``'s order, with a starting position in the global order."""

    def __init__(self, dataset: Dataset, num_replicas: int, rank: int, shuffle: bool = True,
                 seed: int = 0) -> None:
        self.dataset, self.num_replicas, self.rank = dataset, num_replicas, rank
        self.shuffle, self.seed = shuffle, seed
        self.epoch = 0
        self.start = 0  # global positions of this epoch's order already consumed

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _order(self) -> list[int]:
        n = len(self.dataset)
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(n, generator=g).tolist()
        else:
            order = list(range(n))
        total = -(-n // self.num_replicas) * self.num_replicas
        order += (order * (-(-total // max(n, 1))))[:total - n]  # pad by repeating from the start
        return order

    def __iter__(self) -> Iterator[int]:
        order = self._order()
        return iter(order[self.start + self.rank::self.num_replicas])

    def __len__(self) -> int:
        total = -(-len(self.dataset) // self.num_replicas) * self.num_replicas
        return max(0, -(-(total - self.start - self.rank) // self.num_replicas))


class DataLoader(torch.utils.data.DataLoader):
    """A DataLoader over a :class:`ResumableSampler` that reshuffles every epoch and knows its
    position: ``state_dict()`` / ``load_state_dict()`` (saved in checkpoints by the engine)."""

    def __init__(self, dataset: Dataset, *, batch_size: int, num_replicas: int, rank: int,
                 seed: int = 0, **kwargs) -> None:
        sampler = ResumableSampler(dataset, num_replicas, rank, shuffle=True, seed=seed)
        # worker seeds come from this generator, not the global RNG, so starting an epoch does
        # not move the RNG that dropout draws from (a resumed run starts its epoch later)
        kwargs.setdefault("generator", torch.Generator().manual_seed(seed))
        super().__init__(dataset, batch_size=batch_size, sampler=sampler, **kwargs)
        self.epoch = 0            # the epoch the next iteration starts (or continues)
        self._taken = 0           # micro-batches this rank took in the current epoch
        self._resume_at: Optional[int] = None

    def __iter__(self):
        sampler: ResumableSampler = self.sampler
        sampler.set_epoch(self.epoch)
        sampler.start = self._resume_at or 0
        base = (self._resume_at or 0)
        self._resume_at = None
        self._taken = 0
        self.epoch += 1
        self._base = base
        for batch in super().__iter__():
            self._taken += 1
            yield batch
        sampler.start = 0

    def state_dict(self) -> dict:
        """The position: the epoch in progress and how many samples of its order all ranks
        together have consumed."""
        if self._taken == 0 and getattr(self, "_base", 0) == 0:
            return {"epoch": self.epoch, "consumed": 0}
        consumed = getattr(self, "_base", 0) + self._taken * self.batch_size * self.sampler.num_replicas
        return {"epoch": self.epoch - 1, "consumed": consumed}

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state``: the next iteration starts at its position (at any world size)."""
        self.epoch = int(state["epoch"])
        consumed = int(state["consumed"])
        self._resume_at = consumed if consumed < len(self.dataset) else None
        if self._resume_at is None and consumed:
            self.epoch += 1  # that epoch was finished
