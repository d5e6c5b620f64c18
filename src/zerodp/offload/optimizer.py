"""Optimizer offload (ZeRO-Offload to host memory, ZeRO-Infinity to disk).

With ``offload_optimizer``, what the step needs besides the gradient shard on the compute
device lives on the host: each flat group's fp32 master shard and its optimizer states (in host
memory, or with ``nvme`` in files under ``nvme_path``), and the step runs there. The compute
device keeps only the (16-bit or fp32) parameters and the gradient shard.

The step walks this rank's flat groups as tiles (``sub_group_size`` caps a group's shard when
offload is on), in a pipeline:

    copy tile k+1's gradient shard device -> host (pinned buffer, non-blocking)
    (disk: read tile k+1's master and states, in the background)
    tile k: wait for its copy (and read); fp32 gradient on the host; divide, clip; optimizer step
    tile k: round the master into a pinned buffer in the parameter dtype; copy host -> device
            (non-blocking), where the all-gather after the step picks it up
    (disk: write tile k back and free its memory, in the background)

So on a GPU the transfers of one tile overlap the update of the next, and with disk offload at
most three tiles' masters and states are in memory at once (the one written back, the one
updated, the one read ahead). On a CPU device the same code runs; the copies are then
synchronous copies within host memory.
"""
from __future__ import annotations

import logging
from typing import Callable, Optional

import torch

from ..core.device import CopiesDone, host_empty
from ..core.flat import FlatGroup
from ..core.optim_shard import OptimizerShard
from .host import check_host_budget
from .swap import PagedTensors, SwapDir

logger = logging.getLogger("zerodp")

#: Optimizer state elements per parameter element assumed by the host-memory check (Adam's two
#: moments; the check runs before the optimizer has made its state).
STATES_PER_ELEMENT = 2


class OptimizerOffload:
    """The offloaded masters, optimizer states and step of one engine's trainable groups."""

    def __init__(self, zero_config, aio_config, groups: list[FlatGroup], device: torch.device,
                 rank: int) -> None:
        oc = zero_config.offload_optimizer
        self.kind: str = oc.device                      # "cpu" or "nvme"
        self.device = device
        self.pin = bool(oc.pin_memory) and device.type == "cuda"
        self.groups = groups
        largest = max((g.shard_numel for g in groups), default=0)
        grad_bytes = max((g.grads.dtype.itemsize for g in groups), default=4)
        param_bytes = max((g.full.element_size() for g in groups), default=4)
        shard = sum(g.shard_numel for g in groups)
        resident = shard if self.kind == "cpu" else min(shard, 3 * largest)
        check_host_budget({"fp32 master": 4 * resident,
                           "optimizer states (est.)": 4 * STATES_PER_ELEMENT * resident,
                           "transfer buffers": 2 * largest * (grad_bytes + param_bytes) + 4 * largest},
                          self.pin)
        # two of each transfer buffer: one tile in flight while the other is worked on
        self._grad_stage = [host_empty(largest * grad_bytes, torch.uint8, device, self.pin) for _ in range(2)]
        self._param_stage = [host_empty(largest * param_bytes, torch.uint8, device, self.pin) for _ in range(2)]
        self._param_sent: list[Optional[CopiesDone]] = [None, None]
        self._grad32 = torch.empty(largest if grad_bytes != 4 else 0, dtype=torch.float32)
        self.swap: Optional[SwapDir] = None        # masters and states (device "nvme")
        if self.kind == "nvme":
            self.swap = SwapDir(oc.nvme_path, rank, aio_config.block_size, aio_config.queue_depth)
        self._state_flats: dict[int, dict[str, torch.Tensor]] = {g.index: {} for g in groups}
        self.peak_resident_bytes = 0
        self.location = "disk" if self.kind == "nvme" else "host"

    # -- set-up ---------------------------------------------------------------------------

    def make_pieces(self, g: FlatGroup) -> list[torch.nn.Parameter]:
        """``g``'s fp32 master in host memory and the optimizer's pieces of it; with disk
        offload the master goes to its file at once, so no more than one is in memory."""
        master = torch.empty(g.shard_numel, dtype=torch.float32)
        with g.swapped_in():  # parameter shards on disk: read for this
            master.copy_(g.shard)
        shard = OptimizerShard(g, master)
        if self.kind == "nvme":
            shard.page = PagedTensors(self.swap, f"g{g.index}")
            shard.page.add(master)
            shard.page.page_out(wait=True)
        return shard.leaves

    # -- the step -------------------------------------------------------------------------

    def step(self, optimizer: torch.optim.Optimizer, used: list[list[bool]], divisor: float,
             coef: float, before_step: Optional[Callable[[FlatGroup, torch.Tensor], None]] = None) -> None:
        """One optimizer step over all tiles (see module docstring): gradients divided by
        ``divisor``, then multiplied by the clipping ``coef`` when it is below 1; ``before_step(group,
        grad)`` runs on each tile's host gradient first (Muon's whole-matrix update: its
        Newton-Schulz iterations run here, where the optimizer runs)."""
        groups = self.groups
        if not groups:
            return
        saved = [grp["params"] for grp in optimizer.param_groups]
        try:
            pending = self._fetch(0)
            for k, g in enumerate(groups):
                grad_host, copied = pending
                if k + 1 < len(groups):
                    pending = self._fetch(k + 1)
                copied.wait()
                if g.optim.page is not None:
                    g.optim.page.wait()
                    self._note_resident(k)
                grad = grad_host
                if grad.dtype != torch.float32:
                    grad = self._grad32[:g.shard_numel]
                    grad.copy_(grad_host)
                if divisor != 1.0:
                    grad.mul_(1.0 / divisor)
                if coef < 1.0:
                    grad.mul_(coef)
                g.optim.attach_grads(used[k], grad)
                if before_step is not None:
                    before_step(g, grad)
                for gi, grp in enumerate(optimizer.param_groups):
                    grp["params"] = g.optim.leaves if gi == g.param_group else []
                type(optimizer).step(optimizer)
                g.optim.clear_grads()
                self._send_back(k, g)
                if g.optim.page is not None:
                    self.adopt_states(g, optimizer)
                    g.optim.page.page_out()
        finally:
            for grp, params in zip(optimizer.param_groups, saved):
                grp["params"] = params
            self._wait_sent()
            self._wait_pages()

    def _note_resident(self, k: int) -> None:
        """Disk offload: track the most bytes of tiles in memory at once (the one being written
        back, this one, the one read ahead)."""
        near = self.groups[max(0, k - 1):k + 2]
        now = sum(t.untyped_storage().nbytes() for g in near for t in g.optim.page.tensors)
        self.peak_resident_bytes = max(self.peak_resident_bytes, now)

    def _fetch(self, k: int) -> tuple[torch.Tensor, CopiesDone]:
        """Start moving tile ``k``'s gradient shard to the host (and, on disk, its states in)."""
        g = self.groups[k]
        if g.optim.page is not None:
            g.optim.page.page_in(wait=False)
        stage = _as(self._grad_stage[k % 2], g.grads.shard.dtype, g.shard_numel)
        stage.copy_(g.grads.shard, non_blocking=self.pin)
        return stage, CopiesDone(self.device)

    def _send_back(self, k: int, g: FlatGroup) -> None:
        """Round tile ``k``'s master into the parameter dtype on the host; copy it to the shard."""
        slot = k % 2
        if self._param_sent[slot] is not None:
            self._param_sent[slot].wait()  # the buffer's previous copy (tile k - 2) is done
        out = _as(self._param_stage[slot], g.shard.dtype, g.shard_numel)
        out.copy_(g.optim.master)
        page = g.shard_page
        if page is not None:  # parameter shard on disk: overwritten whole, then written back
            page.page_in(read=False)
            g.shard.copy_(out)
            page.page_out()
        else:
            g.shard.copy_(out, non_blocking=self.pin)
        self._param_sent[slot] = CopiesDone(self.device)

    def _wait_sent(self) -> None:
        for i, sent in enumerate(self._param_sent):
            if sent is not None:
                sent.wait()
                self._param_sent[i] = None

    # -- disk: optimizer states in the tile's file -----------------------------------------

    def adopt_states(self, g: FlatGroup, optimizer: torch.optim.Optimizer) -> None:
        """Move the elementwise optimizer states of ``g``'s pieces into the tile's flat state
        tensors (made on the first step, kept in the tile's file) and make the optimizer's state
        entries views of them. Scalars (Adam's step count) stay in memory."""
        flats = self._state_flats[g.index]
        for pc, pp in zip(g.pieces, g.optim.leaves):
            st = optimizer.state.get(pp)
            if not st:
                continue
            for key, v in st.items():
                if not (isinstance(v, torch.Tensor) and v.dim() >= 1 and v.numel() == pp.numel()):
                    continue
                flat = flats.get(key)
                if flat is None:
                    flat = flats[key] = torch.zeros(g.shard_numel, dtype=v.dtype)
                    g.optim.page.add(flat)
                view = flat[pc.shard_lo:pc.shard_hi]
                if v.untyped_storage().data_ptr() != flat.untyped_storage().data_ptr():
                    view.copy_(v.reshape(-1))
                    st[key] = view.view(v.shape)

    # -- what it holds ------------------------------------------------------------------------

    @property
    def buffer_bytes(self) -> int:
        """Host bytes of the transfer buffers (gradient and parameter staging, fp32 gradient)."""
        bufs = self._grad_stage + self._param_stage + [self._grad32]
        return sum(b.numel() * b.element_size() for b in bufs)

    def _wait_pages(self) -> None:
        for g in self.groups:
            for page in g.pages:
                page.wait()

    def close(self) -> None:
        self._wait_pages()
        if self.swap is not None:
            self.swap.close()


def _as(buf: torch.Tensor, dtype: torch.dtype, numel: int) -> torch.Tensor:
    """The first ``numel`` elements of byte buffer ``buf`` as ``dtype``."""
    size = torch.empty((), dtype=dtype).element_size()
    return buf[:numel * size].view(dtype)

