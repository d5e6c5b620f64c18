"""Streamed inference (ZeRO-Inference): run a model whose weights stay in safetensors files,
bringing each module's weights to the compute device just before it runs.

    with zerodp.zero.Init(meta=True):             # parameters without storage; buffers real
        model = AutoModelForCausalLM.from_config(config)   # or build_gpt(...)
    model = zerodp.inference.stream(model, "weights_dir_or_file")
    out = model.generate(input_ids, max_new_tokens=20)      # or model(input_ids)

Modules whose own parameters number at least ``threshold`` elements are *streamed*: a forward
pre-hook puts their parameters on the device (read from the files, or taken from a read started
in the background when the previous streamed module ran, in the order the first forward
recorded) and a forward post-hook drops them again. Smaller modules' parameters (norms, biases,
position embeddings below the threshold) are loaded once and stay. So at most two streamed
modules' weights are in memory at once: the one running and the one read ahead.
:attr:`StreamedModel.peak_streamed_bytes` records the most there ever were.

Weights: a ``.safetensors`` file or a directory of them (what ``zerodp consolidate`` and
``save_pretrained`` write), read through ``safetensors.safe_open`` (memory-mapped). A parameter
registered under several names (tied weights) is found under any of them.
"""
from __future__ import annotations

import threading
from collections import defaultdict
from pathlib import Path
from typing import Optional, Union

import torch
from torch import nn

from ..core.device import default_device
from ..core.init_shards import full_shape, init_shard

__all__ = ["StreamedModel", "stream"]

#: Modules with at least this many parameter elements of their own are streamed.
DEFAULT_THRESHOLD = 100_000


class _Weights:
    """Tensor name -> the safetensors file holding it (one file, or every file in a directory)."""

    def __init__(self, path: Union[str, Path]) -> None:
        from safetensors import safe_open
        path = Path(path)
        files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
        if not files or not all(f.is_file() for f in files):
            raise FileNotFoundError(f"{path}: no .safetensors file there (write one with zerodp consolidate "
                                    "or save_pretrained)")
        self._handles = [safe_open(str(f), framework="pt", device="cpu") for f in files]
        self.where = {name: h for h in self._handles for name in h.keys()}

    def name_of(self, names: list[str]) -> str:
        for name in names:
            if name in self.where:
                return name
        raise KeyError(f"none of {names} is in the weights ({len(self.where)} tensors)")

    def shape(self, names: list[str]) -> tuple[int, ...]:
        name = self.name_of(names)
        return tuple(self.where[name].get_slice(name).get_shape())

    def get(self, names: list[str]) -> torch.Tensor:
        name = self.name_of(names)
        return self.where[name].get_tensor(name)


class StreamedModel(nn.Module):
    """``model`` (parameters on the meta device) run with weights streamed from ``weights``."""

    def __init__(self, model: nn.Module, weights: Union[str, Path], *, device: Optional[torch.device] = None,
                 dtype: Optional[torch.dtype] = None, threshold: int = DEFAULT_THRESHOLD) -> None:
        super().__init__()
        self.module = model
        self.device = device or default_device()
        self.dtype = dtype
        self.weights = _Weights(weights)
        self._lock = threading.Lock()  # one reader of the files at a time (main and read-ahead threads)
        self._names: dict[int, list[str]] = defaultdict(list)   # id(param) -> its names
        self._holders: dict[int, list[tuple[nn.Module, str]]] = defaultdict(list)
        self._meta: dict[int, nn.Parameter] = {}
        in_init: dict[int, nn.Parameter] = {}  # built in zero.Init without meta=True -> its meta stand-in
        for mname, mod in model.named_modules():
            for pname, p in list(mod._parameters.items()):
                if p is None:
                    continue
                if init_shard(p) is not None:  # its slice is not needed, the weights are read from the files
                    if id(p) not in in_init:
                        in_init[id(p)] = nn.Parameter(torch.empty(full_shape(p), dtype=p.dtype, device="meta"),
                                                      requires_grad=p.requires_grad)
                    p = mod._parameters[pname] = in_init[id(p)]
                if not p.is_meta:
                    raise ValueError(f"{mname}.{pname} is not on the meta device: build the model inside "
                                     "zerodp.zero.Init(meta=True), so no weight is held twice")
                self._names[id(p)].append(f"{mname}.{pname}" if mname else pname)
                self._holders[id(p)].append((mod, pname))
                self._meta[id(p)] = p
        for pid, meta in self._meta.items():  # every weight is there, in its shape: fail now, not mid-forward
            shape = self.weights.shape(self._names[pid])
            if shape != tuple(meta.shape):
                raise ValueError(f"{self._names[pid][0]}: the weights hold shape {shape}, "
                                 f"the model {tuple(meta.shape)}")
        for name, buf in model.named_buffers():
            if buf.is_meta:
                raise ValueError(f"buffer {name} is on the meta device; build buffers with real values "
                                 "(zerodp.zero.Init keeps them real)")
        self.streamed: list[nn.Module] = []
        self._index: dict[int, int] = {}         # id(streamed module) -> its index
        self._pids: list[list[int]] = []          # per streamed module: its parameters (meta ids)
        for mod in model.modules():
            own = [p for p in mod._parameters.values() if p is not None]
            if not own or sum(p.numel() for p in own) < threshold:
                continue
            self._index[id(mod)] = len(self.streamed)
            self.streamed.append(mod)
            self._pids.append([id(p) for p in own])
            mod.register_forward_pre_hook(self._before)
            mod.register_forward_hook(self._after)
        streamed_ids = {pid for pids in self._pids for pid in pids}
        self.resident_bytes = 0
        for pid in self._meta:
            if pid not in streamed_ids:
                self.resident_bytes += self._put(pid, self._read(pid))
        self._order: list[int] = []        # streamed modules, in the order the first forward ran them
        self._recorded = False
        self._loaded: dict[int, int] = {}  # id(param) -> bytes, streamed parameters on the device now
        self._ahead: Optional[tuple[int, threading.Thread, dict]] = None
        self.peak_streamed_bytes = 0

    # -- weights in and out -------------------------------------------------------------------

    def _read(self, pid: int) -> torch.Tensor:
        """Parameter ``pid``'s tensor from the files, on the host."""
        with self._lock:
            return self.weights.get(self._names[pid])

    def _put(self, pid: int, host: torch.Tensor) -> int:
        dtype = self.dtype if self.dtype is not None and host.is_floating_point() else self._meta[pid].dtype
        p = nn.Parameter(host.to(self.device, dtype), requires_grad=False)
        for mod, name in self._holders[pid]:
            mod._parameters[name] = p
        return p.numel() * p.element_size()

    def _drop(self, pid: int) -> None:
        for mod, name in self._holders[pid]:
            mod._parameters[name] = self._meta[pid]

    # -- hooks ----------------------------------------------------------------------------------

    def _before(self, mod: nn.Module, args) -> None:
        index = self._index[id(mod)]
        if not self._recorded:
            if index in self._order:  # the order came round again: it is recorded
                self._recorded = True
            else:
                self._order.append(index)
        host: dict[int, torch.Tensor] = {}
        if self._ahead is not None and self._ahead[0] == index:
            _, thread, host = self._ahead
            thread.join()
            self._ahead = None
        for pid in self._pids[index]:
            if pid not in self._loaded:
                self._loaded[pid] = self._put(pid, host[pid] if pid in host else self._read(pid))
        self._read_ahead(index)
        ahead = sum(t.numel() * t.element_size() for t in (self._ahead[2].values() if self._ahead else ()))
        self.peak_streamed_bytes = max(self.peak_streamed_bytes, sum(self._loaded.values()) + ahead)

    def _after(self, mod: nn.Module, args, output) -> None:
        for pid in self._pids[self._index[id(mod)]]:
            if pid in self._loaded:
                self._drop(pid)
                del self._loaded[pid]

    def _read_ahead(self, index: int) -> None:
        """Start reading the streamed module that ran after ``index`` in the recorded order."""
        if not self._recorded or self._ahead is not None or index not in self._order:
            return
        pos = self._order.index(index)
        nxt = self._order[(pos + 1) % len(self._order)]
        pids = [pid for pid in self._pids[nxt] if pid not in self._loaded]
        out: dict[int, torch.Tensor] = {}

        def read() -> None:
            for pid in pids:
                out[pid] = self._read(pid)
        thread = threading.Thread(target=read, name="zerodp-stream", daemon=True)
        thread.start()
        self._ahead = (nxt, thread, out)

    def forward(self, *args, **kwargs):
        with torch.no_grad():
            out = self.module(*args, **kwargs)
        self._recorded = True
        return out

    def generate(self, *args, **kwargs):
        """The wrapped model's ``generate`` (every forward inside it streams)."""
        with torch.no_grad():
            out = self.module.generate(*args, **kwargs)
        self._recorded = True
        return out


def stream(model: nn.Module, weights: Union[str, Path], **kwargs) -> StreamedModel:
    """``StreamedModel(model, weights, **kwargs)``: see the module docstring."""
    return StreamedModel(model, weights, **kwargs)
