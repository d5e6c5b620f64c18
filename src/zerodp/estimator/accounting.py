"""Bytes per parameter element: the precisions, the optimizers and their states, and the three
accountings (``mixed``, ``no-master``, ``fp32``) with the per-stage formulas in Ψ and N."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

from .inputs import EstimateError

PRECISIONS = {"fp32": 4, "bf16": 2, "fp16": 2}
ACCOUNTINGS = ("mixed", "no-master", "fp32")
FP32 = 4


@dataclass(frozen=True)
class OptimizerSpec:
    """An optimizer's persistent state: ``states`` values per parameter element."""

    name: str
    states: int
    what: str


OPTIMIZERS: dict[str, OptimizerSpec] = {
    "adamw": OptimizerSpec("AdamW", 2, "m, v"),
    "adam": OptimizerSpec("Adam", 2, "m, v"),
    "amsgrad": OptimizerSpec("Adam/AdamW with amsgrad", 3, "m, v, max v"),
    "adamax": OptimizerSpec("Adamax", 2, "m, infinity norm"),
    "nadam": OptimizerSpec("NAdam", 2, "m, v"),
    "radam": OptimizerSpec("RAdam", 2, "m, v"),
    "adadelta": OptimizerSpec("Adadelta", 2, "square average, delta"),
    "lion": OptimizerSpec("Lion", 1, "momentum"),
    # Muon's matrices; its AdamW half (embeddings, output layer, norms, biases) keeps AdamW's 2
    "muon": OptimizerSpec("Muon (its matrices)", 1, "momentum"),
    "adagrad": OptimizerSpec("Adagrad", 1, "sum of squares"),
    "rmsprop": OptimizerSpec("RMSprop", 1, "square average"),
    "sgd-momentum": OptimizerSpec("SGD with momentum", 1, "momentum buffer"),
    "sgd": OptimizerSpec("SGD without momentum", 0, "none"),
}


def _optimizer(name: Union[str, OptimizerSpec]) -> OptimizerSpec:
    if isinstance(name, OptimizerSpec):
        return name
    key = str(name).strip().lower().replace("_", "-")
    if key not in OPTIMIZERS:
        raise EstimateError("optimizer", f"{name!r} is unknown; allowed: {', '.join(OPTIMIZERS)}")
    return OPTIMIZERS[key]


@dataclass(frozen=True)
class Accounting:
    """Bytes per parameter element of each kind of model state."""

    name: str
    params: int
    grads: int
    master: int
    states: int

    @property
    def k(self) -> int:
        """The ZeRO paper's K: bytes of optimizer state (master copy included) per parameter."""
        return self.master + self.states

    def describe(self, optimizer: OptimizerSpec) -> str:
        opt = f"{optimizer.name} {optimizer.what}" if optimizer.states else optimizer.name
        kinds = {"mixed": "mixed precision, the ZeRO paper's accounting",
                 "no-master": "16-bit parameters and gradients, fp32 optimizer states, no fp32 master copy",
                 "fp32": "fp32 training; the parameters are the master weights"}[self.name]
        parts = [f"params {self.params}", f"grads {self.grads}"]
        parts += [f"fp32 master {self.master}"] if self.master else []
        parts += [f"optimizer states {self.states} ({opt})"]
        return f"{self.name} ({kinds}): bytes per parameter: {' + '.join(parts)}; K = {self.k}"

    def formulas(self) -> str:
        """The per-rank model-state bytes of each stage, as formulas in Ψ and N."""
        full, p = self.params + self.grads + self.k, self.params
        return (f"stage 0 {full}Ψ, stage 1 {p + self.grads}Ψ + {self.k}Ψ/N, "
                f"stage 2 {p}Ψ + {self.grads + self.k}Ψ/N, stage 3 {full}Ψ/N")


def make_accounting(precision: str, optimizer: OptimizerSpec, name: Optional[str] = None) -> Accounting:
    """The accounting ``name`` (default: ``mixed`` for 16-bit precision, ``fp32`` for fp32)."""
    if precision not in PRECISIONS:
        raise EstimateError("precision", f"{precision!r}; allowed: {', '.join(PRECISIONS)}")
    name = name or ("fp32" if precision == "fp32" else "mixed")
    if name not in ACCOUNTINGS:
        raise EstimateError("accounting", f"{name!r}; allowed: {', '.join(ACCOUNTINGS)}")
    if (name == "fp32") != (precision == "fp32"):
        allowed = "fp32" if precision == "fp32" else "mixed or no-master"
        raise EstimateError("accounting", f"{name} does not go with precision {precision}; "
                                          f"allowed for {precision}: {allowed}")
    p = PRECISIONS[precision]
    master = FP32 if name == "mixed" else 0
    return Accounting(name, params=p, grads=p, master=master, states=FP32 * optimizer.states)
