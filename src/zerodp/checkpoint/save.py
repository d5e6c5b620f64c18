"""Saving: every rank writes its own file in parallel; rank 0 commits the whole atomically.

A save of tag ``T`` into ``DIR`` goes:

1. every rank plans what it writes (``layout.RankPlan``) and rank 0 the index; the ranks agree
   that all plans worked and that they save the same tag;
2. rank 0 makes ``DIR/.T.partial/`` (removing what an interrupted save left there);
3. every rank writes ``rankNNNNN.safetensors`` (its shard, checksummed while written) and
   ``rankNNNNN.json`` (its optimizer scalars, RNG state, the file's checksums) and fsyncs them;
4. rank 0 reads the ranks' records into ``index.json``, fsyncs it, renames the directory to
   ``DIR/T`` (a previous ``DIR/T`` is moved to ``DIR/.T.old`` first and removed after) and
   replaces ``DIR/latest`` by a new file naming ``T``.

Each step ends with an agreement (``coord.py``), so when a rank fails every rank raises. A
process killed at any point leaves ``DIR/latest`` and the checkpoint it names untouched:
until the final renames nothing outside ``.T.partial`` changed, and each rename is atomic.
Loading never looks at ``.partial`` directories; the next save removes them.

With ``async_save``, steps 3-4 run in a background thread from a host copy of this rank's
tensors (``Staging``: one reused buffer, pinned on a GPU, filled while training goes on; the
next optimizer step waits for the copy, not for the write), agreeing through the job's store
(``coord.py``). The copy costs host memory equal to this rank's file, kept for the next
asynchronous save. The next save, a load, ``engine.wait_for_checkpoint()`` and
``engine.destroy()`` wait for a save in flight and raise its error, if it had one.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import time
import zlib
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional

import torch

from .._version import __version__
from ..core.view import CheckpointView
from .coord import Coordinator
from .layout import RankPlan, merge_rank_records, optimizer_record, rank_file, rank_json
from .source import CheckpointError
from .state import capture_rng, encode
from .tensorfile import FileRecord, TensorWriter, checksum

logger = logging.getLogger("zerodp")

INDEX = "index.json"
LATEST = "latest"
#: Bytes per copy from device memory to the host while writing synchronously.
HOST_CHUNK = 64 << 20


def check_tag(tag: str) -> None:
    if not tag or "/" in tag or "\\" in tag or tag.startswith(".") or tag != tag.strip():
        raise ValueError(f"checkpoint tag {tag!r}: a tag is a non-empty directory name that does not "
                         "start with '.' (reserved for saves in progress) and holds no '/'")


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_durably(path: Path, data: Any) -> FileRecord:
    raw = json.dumps(data, indent=1, allow_nan=True).encode("utf-8")
    with open(path, "wb") as f:
        f.write(raw)
        f.flush()
        os.fsync(f.fileno())
    return checksum(raw)


def write_latest(save_dir: Path, tag: str) -> None:
    """Replace ``save_dir/latest`` atomically by a file holding ``tag``."""
    tmp = save_dir / ".latest.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(tag)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, save_dir / LATEST)
    fsync_dir(save_dir)


def _host_parts(parts: Iterable[torch.Tensor]) -> Iterator[torch.Tensor]:
    """``parts`` as CPU tensors. Device tensors go through two reused pinned host buffers, a
    chunk at a time: the next chunk is copied while the writer writes this one (the writer is
    done with a chunk when it asks for the next)."""
    buffers: list[Optional[torch.Tensor]] = [None, None]
    pending = None  # (host chunk, copy event) not yet handed out
    k = 0
    for part in parts:
        if part.device.type == "cpu":
            if pending is not None:
                pending[1].synchronize()
                yield pending[0]
                pending = None
            yield part
            continue
        flat = part.reshape(-1)
        step = max(1, HOST_CHUNK // flat.element_size())
        for i in range(0, flat.numel(), step):
            piece = flat[i:i + step]
            nbytes = piece.numel() * piece.element_size()
            if buffers[k] is None or buffers[k].numel() < nbytes:
                buffers[k] = torch.empty(max(nbytes, HOST_CHUNK), dtype=torch.uint8, pin_memory=True)
            host = buffers[k][:nbytes].view(piece.dtype)
            host.copy_(piece, non_blocking=True)
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(part.device))
            if pending is not None:
                pending[1].synchronize()
                yield pending[0]
            pending, k = (host, event), 1 - k
    if pending is not None:
        pending[1].synchronize()
        yield pending[0]


class Staging:
    """Host copies of everything a rank writes, for asynchronous saves.

    One buffer (pinned when the tensors live on a GPU) is allocated at the first asynchronous
    save and reused by the next ones while it is large enough: allocating and pinning gigabytes
    costs more than copying them. The copy does not hold up ``save_checkpoint``: on a GPU it is
    queued on a side stream, on a CPU a background thread makes it. The tensors it copies are
    changed only by the optimizer step, so ``engine.step()`` waits for the copy (``wait_copied``)
    before updating; forward and backward run meanwhile (stage 3 keeps each shard's storage
    while its unit is gathered until the copy is done, instead of freeing it).
    """

    ALIGN = 64

    def __init__(self) -> None:
        self.buffer: Optional[torch.Tensor] = None
        self._event = None                    # CUDA: the copy stream's event
        self._copied = threading.Event()
        self._copied.set()
        self._pending: list = []              # (source parts, destination) for the CPU copy
        self._groups: list = []               # the flat groups whose shards are being copied

    @property
    def nbytes(self) -> int:
        return 0 if self.buffer is None else self.buffer.numel()

    def start(self, plan: RankPlan, copy_now: bool = False) -> dict[str, torch.Tensor]:
        """Views of the staging buffer for every tensor of ``plan``, and the copy into them
        started; with ``copy_now`` (optimizer states on disk, read in tile by tile while copied)
        the copy is made before this returns."""
        if copy_now:
            views = self._views(plan, plan.view.device.type == "cuda")
            for name, out in views.items():
                _copy_parts(plan.parts_of(name), out)
            self._event, self._pending = None, []
            return views
        parts = {spec.name: list(plan.parts_of(spec.name)) for spec in plan.specs}
        self._groups = plan.view.flat_groups
        for g in self._groups:  # stage 3 keeps each shard's storage while gathered until copied
            g.copying_shard(True)
        on_gpu = any(p.device.type == "cuda" for ps in parts.values() for p in ps)
        views = self._views(plan, on_gpu)
        work = [(parts[name], views[name]) for name in views]
        self._copied.clear()
        if on_gpu:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for ps, out in work:
                    _copy_parts(ps, out, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record(stream)
            self._pending = work  # keeps temporaries alive until the copy is done
        else:
            self._event = None
            self._pending = work
        return views

    def _views(self, plan: RankPlan, pinned: bool) -> dict[str, torch.Tensor]:
        """The (re)used buffer, cut into one view per tensor of ``plan``."""
        sizes = [-(-spec.nbytes // self.ALIGN) * self.ALIGN for spec in plan.specs]
        total = max(sum(sizes), self.ALIGN)
        if self.buffer is None or self.buffer.numel() < total or self.buffer.is_pinned() != pinned:
            self.buffer = None
            self.buffer = torch.empty(total, dtype=torch.uint8, pin_memory=pinned)
        views, pos = {}, 0
        for spec, size in zip(plan.specs, sizes):
            views[spec.name] = self.buffer[pos:pos + spec.nbytes].view(spec.dtype)
            pos += size
        return views

    def copy_in_background(self) -> None:
        """The background thread's first task: finish the copy (CPU: make it)."""
        try:
            if self._event is not None:
                self._event.synchronize()
            else:
                for ps, out in self._pending:
                    _copy_parts(ps, out)
        finally:
            self._pending = []
            for g in self._groups:
                g.copying_shard(False)
            self._copied.set()

    def wait_copied(self) -> None:
        """Before the optimizer changes the tensors being copied: wait for the copy (on a GPU the
        current stream waits for the copy stream, the host does not)."""
        if self._event is not None and not self._copied.is_set():
            torch.cuda.current_stream().wait_event(self._event)
            return
        self._copied.wait()


def _copy_parts(parts: Iterable[torch.Tensor], out: torch.Tensor, non_blocking: bool = False) -> None:
    pos = 0
    for p in parts:
        n = p.numel()
        out[pos:pos + n].copy_(p.reshape(-1), non_blocking=non_blocking)
        pos += n


class _Job:
    """Everything steps 3-4 need, detached from the engine."""

    def __init__(self, plan: RankPlan, index: Optional[dict], save_dir: Path, tag: str,
                 save_latest: bool, staging: Optional[Staging] = None) -> None:
        self.specs, self.rank_json, self.index = plan.specs, plan.json, index
        self.rank, self.world = plan.rank, plan.world
        self.save_dir, self.tag, self.save_latest = save_dir, tag, save_latest
        self.partial = save_dir / f".{tag}.partial"
        self.staging = staging
        paged = any(g.pages for g in plan.view.flat_groups)
        self.staged = staging.start(plan, copy_now=paged) if staging is not None else None
        self._plan = None if staging is not None else plan
        self.nbytes = sum(s.nbytes for s in plan.specs)

    def parts(self, name: str) -> Iterator[torch.Tensor]:
        if self.staged is not None:
            yield self.staged[name]
        else:
            yield from _host_parts(self._plan.parts_of(name))

    def write_rank(self) -> None:
        if self.staging is not None:
            self.staging.copy_in_background()
        writer = TensorWriter(self.partial / rank_file(self.rank), self.specs,
                              metadata={"format": "zerodp", "rank": str(self.rank)})
        try:
            for spec in writer.order:
                writer.write(spec.name, self.parts(spec.name))
        except BaseException:
            writer.abort()
            raise
        self.rank_json["file"] = writer.close().to_json()
        write_json_durably(self.partial / rank_json(self.rank), self.rank_json)
        self.staged = None

    def commit(self) -> None:
        """Rank 0: the index, the rename, ``latest``."""
        index, files = self.index, {}
        records = []
        for r in range(self.world):
            raw = (self.partial / rank_json(r)).read_bytes()
            rec = json.loads(raw)
            records.append(rec)
            files[rank_file(r)] = rec["file"]
            files[rank_json(r)] = checksum(raw).to_json()
        merge_rank_records(index, records)
        index["files"] = files
        write_json_durably(self.partial / INDEX, index)
        fsync_dir(self.partial)
        final, old = self.save_dir / self.tag, self.save_dir / f".{self.tag}.old"
        if final.exists():
            if old.exists():
                shutil.rmtree(old)
            os.rename(final, old)
        os.rename(self.partial, final)
        fsync_dir(self.save_dir)
        if old.exists():
            shutil.rmtree(old, ignore_errors=True)
        if self.save_latest:
            write_latest(self.save_dir, self.tag)

    def run(self, coord: Coordinator) -> None:
        t0 = time.perf_counter()
        err = None
        try:
            self.write_rank()
        except Exception as e:  # noqa: BLE001 - reported to every rank
            err = e
        try:
            coord.agree(err, f"writing checkpoint {self.save_dir / self.tag}")
            err = None
            if self.rank == 0:
                try:
                    self.commit()
                except Exception as e:  # noqa: BLE001
                    err = e
            coord.agree(err, f"committing checkpoint {self.save_dir / self.tag}")
        except BaseException:
            if self.rank == 0:
                shutil.rmtree(self.partial, ignore_errors=True)
            raise
        if self.rank == 0:
            dt = time.perf_counter() - t0
            logger.info("saved checkpoint %s (rank 0 wrote %.1f MiB in %.2f s)",
                        self.save_dir / self.tag, self.nbytes / 2**20, dt)


class Checkpointer:
    """An engine's saves, through its checkpoint view: at most one asynchronous save in flight."""

    def __init__(self, view: CheckpointView) -> None:
        self.view = view
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None
        self._what = ""
        self.staging: Optional[Staging] = None

    def before_update(self) -> None:
        """Called by the engine before the optimizer step changes the parameters and states."""
        if self.staging is not None:
            self.staging.wait_copied()

    def release_staging(self) -> None:
        """Free the host buffer of asynchronous saves (after waiting for any in flight)."""
        self.wait()
        self.staging = None

    def wait(self) -> None:
        """Wait for a save in flight; raise its error if it failed."""
        if self._thread is None:
            return
        self._thread.join()
        self._thread = None
        err, self._error = self._error, None
        if err is not None:
            raise CheckpointError(f"asynchronous save of {self._what} failed: {err}") from err

    @property
    def in_flight(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def save(self, save_dir, tag: Optional[str] = None, client_state: Optional[dict] = None,
             save_latest: bool = True, exclude_frozen_parameters: bool = False,
             async_save: bool = False) -> bool:
        self.wait()
        view = self.view
        save_dir = Path(save_dir)
        tag = str(tag) if tag is not None else f"global_step{view.global_steps}"
        coord = Coordinator(view.ranks.coord_comm)
        err, plan, index = None, None, None
        try:
            check_tag(tag)
            plan = RankPlan(view, exclude_frozen=exclude_frozen_parameters)
            rng_tensors: dict[str, torch.Tensor] = {}
            plan.json["rng"] = capture_rng(rng_tensors)
            for k, v in rng_tensors.items():
                plan.add_whole(k, v)
        except Exception as e:  # noqa: BLE001 - reported to every rank
            err = e
        coord.agree(err, f"saving checkpoint {tag!r}")
        tags = coord.same_everywhere(zlib.crc32(tag.encode()))
        if len(set(tags)) > 1:
            raise CheckpointError(f"save_checkpoint: the ranks passed different tags (this rank: {tag!r}); "
                                  "pass the same tag on every rank, or none")
        stages = None  # with pipeline stages, each stage's part of the index, gathered at the first stage
        if view.ranks.pipe_size > 1 and view.ranks.stage_first:
            stages = view.ranks.pipe_comm.all_gather_objects(plan.stage_skeleton())
        err = None
        if view.ranks.writer_rank == 0:
            try:
                index = self._index(plan, tag, client_state, stages)
                save_dir.mkdir(parents=True, exist_ok=True)
                for stale in sorted(save_dir.glob(".*.partial")):
                    logger.warning("removing %s, an incomplete save left by an interrupted run", stale)
                    shutil.rmtree(stale)
                (save_dir / f".{tag}.partial").mkdir()
            except Exception as e:  # noqa: BLE001
                err = e
        coord.agree(err, f"creating checkpoint directory {save_dir / tag}")
        if not async_save:
            _Job(plan, index, save_dir, tag, save_latest).run(coord)
            return True
        if self.staging is None:
            self.staging = Staging()
        job = _Job(plan, index, save_dir, tag, save_latest, staging=self.staging)
        background = Coordinator(view.ranks.coord_comm, separate=True)
        self._what = str(save_dir / tag)

        def run() -> None:
            try:
                job.run(background)
            except BaseException as e:  # noqa: BLE001 - raised by wait()
                self._error = e
                logger.error("asynchronous save of %s failed: %s", save_dir / tag, e)
        self._thread = threading.Thread(target=run, name="zerodp-checkpoint", daemon=False)
        self._thread.start()
        return True

    def _index(self, plan: RankPlan, tag: str, client_state: Optional[dict],
               stages: Optional[list[dict]] = None) -> dict:
        view = self.view
        tensors: dict[str, torch.Tensor] = {}
        index = plan.index_skeleton(stages)
        index["tag"] = tag
        index["engine"] = {"global_steps": view.global_steps, "micro_steps": view.micro_steps,
                           "skipped_steps": view.skipped_steps,
                           "global_samples": view.global_steps * view.train_batch_size,
                           "train_batch_size": view.train_batch_size,
                           "train_micro_batch_size_per_gpu": view.train_micro_batch_size_per_gpu,
                           "gradient_accumulation_steps": view.gradient_accumulation_steps}
        index["optimizer"] = optimizer_record(view, tensors)
        index["lr_scheduler"] = (encode(view.lr_scheduler.state_dict(), tensors, "sched.", "lr_scheduler state")
                                 if view.lr_scheduler is not None else None)
        index["loss_scaler"] = view.loss_scaler.state_dict() if view.loss_scaler is not None else None
        loader = view.training_dataloader
        index["data_loader"] = loader.state_dict() if hasattr(loader, "state_dict") else None
        index["client_state"] = encode(client_state if client_state is not None else {}, tensors, "client.")
        for k, v in tensors.items():
            plan.add_whole(k, v)
        index["zerodp_version"], index["torch_version"] = __version__, torch.__version__
        return index
