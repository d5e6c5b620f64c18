"""Allow-listed unpickling of the ``torch.save`` files DeepSpeed writes.

A DeepSpeed checkpoint is a set of pickles. They are read only with ``torch.load(weights_only=True,
mmap=True)`` and, for the few DeepSpeed types they hold, inert stand-in classes registered under
DeepSpeed's names (:data:`ALLOWED_GLOBALS`): building one sets attributes and runs no method. Before
anything is unpickled, the pickle is disassembled and a file that names any other global is
refused, naming it. Only the zip format of ``torch.save`` is read; a file in the legacy format
(``_use_new_zipfile_serialization=False``) is refused, saying so.
"""
from __future__ import annotations

import enum
import pickletools
import zipfile
from pathlib import Path
from typing import Any

import torch

from .source import CheckpointError


class _FragmentAddress:
    """Stand-in for ``deepspeed.utils.tensor_fragment.fragment_address`` (``numel``, ``start``)."""


class _ZeroStage(enum.IntEnum):
    """Stand-in for ``deepspeed.runtime.zero.config.ZeroStageEnum``."""

    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3


class _StaticLossScaler:
    """Stand-in for ``deepspeed.runtime.fp16.loss_scaler.LossScaler`` (``cur_scale``)."""


class _DynamicLossScaler:
    """Stand-in for ``deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler`` (``cur_scale``,
    ``cur_iter``, ``last_overflow_iter``, ``cur_hysteresis``, ``scale_window`` ...)."""


#: The only globals beyond torch's own ``weights_only`` set that a DeepSpeed file may name,
#: and the inert classes that are built in their place (attributes only, no methods run).
ALLOWED_GLOBALS: dict[str, type] = {
    "deepspeed.utils.tensor_fragment.fragment_address": _FragmentAddress,
    "deepspeed.runtime.zero.config.ZeroStageEnum": _ZeroStage,
    "deepspeed.runtime.fp16.loss_scaler.LossScaler": _StaticLossScaler,
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler": _DynamicLossScaler,
}


def _pickle_globals(path: Path) -> set[str]:
    """Every global the pickle of a ``torch.save`` zip names, found by disassembly (nothing runs)."""
    with zipfile.ZipFile(path) as zf:
        records = [n for n in zf.namelist() if n == "data.pkl" or n.endswith("/data.pkl")]
        if len(records) != 1:
            raise ValueError("no data.pkl record")
        data = zf.read(records[0])
    found: set[str] = set()
    for opcode, arg, _ in pickletools.genops(data):
        if opcode.name in ("GLOBAL", "INST"):
            found.add(str(arg).replace(" ", "."))
        elif opcode.name == "STACK_GLOBAL":
            raise ValueError("the pickle names a global by STACK_GLOBAL, which torch.save never writes")
    return found


#: The number the legacy ``torch.save`` format (before PyTorch 1.6, and with
#: ``_use_new_zipfile_serialization=False`` since) pickles first (``torch.serialization.MAGIC_NUMBER``).
_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C


def is_legacy_torch_save(path: Path) -> bool:
    """Whether ``path`` is a ``torch.save`` file in the legacy (non-zip) format: not a zip, and
    its first pickle holds only torch's magic number (read by disassembly; nothing runs)."""
    try:
        if zipfile.is_zipfile(path):
            return False
        with open(path, "rb") as f:
            head = f.read(64)
        ops = [(op.name, arg) for op, arg, _ in pickletools.genops(head)]
    except Exception:  # noqa: BLE001 - unreadable or not a pickle: not that format
        return False
    return [name for name, _ in ops] == ["PROTO", "LONG1", "STOP"] and ops[1][1] == _LEGACY_MAGIC


def _legacy_refusal(path: Path) -> CheckpointError:
    return CheckpointError(
        f"{path} is a torch.save file in the legacy format (not a zip archive: written by PyTorch "
        "before 1.6, or with torch.save(..., _use_new_zipfile_serialization=False)); it is not loaded. "
        "zerodp reads only the zip format, which every DeepSpeed checkpoint uses: it checks the "
        "globals a pickle names before anything is unpickled and maps the tensors from the file, "
        "and neither can be done for the legacy format. To use the file, re-save it in the zip "
        "format with a torch whose weights-only loader reads it: "
        "torch.save(torch.load(path, weights_only=True), path)")


def load_pickle(path: Path) -> Any:
    """``torch.load`` of a DeepSpeed file with ``weights_only=True`` and ``mmap=True``, after
    checking that it names no global beyond torch's tensor types and :data:`ALLOWED_GLOBALS`.

    Raises :class:`CheckpointError` for a missing, unreadable or disallowed file.
    """
    if not path.is_file():
        raise CheckpointError(f"{path} does not exist")
    try:
        names = _pickle_globals(path)
        torch_unsafe = set(torch.serialization.get_unsafe_globals_in_checkpoint(str(path)))
    except Exception as exc:
        if is_legacy_torch_save(path):
            raise _legacy_refusal(path) from None
        raise CheckpointError(f"{path} cannot be read ({type(exc).__name__}: {exc}): the file is truncated "
                              "or is not a torch.save file") from None
    # globals some other code registered process-wide are no exception here
    registered = set()
    for entry in torch.serialization.get_safe_globals():
        if isinstance(entry, tuple):
            registered.add(entry[1])
        else:
            registered.add(f"{getattr(entry, '__module__', '')}.{getattr(entry, '__qualname__', '')}")
    refused = sorted(n for n in names if n not in ALLOWED_GLOBALS and (n in torch_unsafe or n in registered))
    if refused:
        raise CheckpointError(
            f"{path} holds the global{'s' if len(refused) > 1 else ''} {', '.join(refused)}, which is not "
            "one of the tensors or DeepSpeed types a DeepSpeed checkpoint holds; the file is not loaded "
            "because zerodp never unpickles arbitrary objects")
    try:
        with torch.serialization.safe_globals([(cls, name) for name, cls in ALLOWED_GLOBALS.items()]):
            return torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:
        raise CheckpointError(f"{path} cannot be read ({type(exc).__name__}: {exc}); it is not loaded "
                              "because zerodp never unpickles arbitrary objects") from None
