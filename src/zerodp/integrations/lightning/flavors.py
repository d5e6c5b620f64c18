"""The two ways Lightning is installed: the unified ``lightning`` package (``lightning.pytorch``,
``lightning.fabric``) and the standalone ``pytorch_lightning`` with ``lightning_fabric``. Their
classes are distinct (a ``pytorch_lightning.Trainer`` accepts only ``pytorch_lightning``
strategies), so the strategies are made once for each that is installed, from the same code."""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType


@dataclass(frozen=True)
class Flavor:
    package: str  # what ``pip install`` names: "lightning" or "pytorch_lightning"
    trainer: str  # the Trainer's package: "lightning.pytorch" or "pytorch_lightning"
    fabric: str   # Fabric's package: "lightning.fabric" or "lightning_fabric"
    face: str     # zerodp's module that offers the strategies

    def trainer_module(self, name: str) -> ModuleType:
        return importlib.import_module(f"{self.trainer}.{name}")

    def fabric_module(self, name: str) -> ModuleType:
        return importlib.import_module(f"{self.fabric}.{name}")

    def require(self) -> None:
        try:
            importlib.import_module(self.trainer)
        except ImportError as e:
            raise ImportError(f"{self.face} needs {self.package}: pip install {self.package}"
                              + (" (or pip install 'zerodp[lightning]')" if self.package == "lightning" else "")) from e


UNIFIED = Flavor("lightning", "lightning.pytorch", "lightning.fabric", "zerodp.lightning")
STANDALONE = Flavor("pytorch_lightning", "pytorch_lightning", "lightning_fabric", "zerodp.pytorch_lightning")
