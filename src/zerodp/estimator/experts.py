"""Expert parallelism in the estimate (``estimate(..., ep=N)``, ``zerodp estimate --ep N``).

A rank of an expert-parallel group of ``ep`` holds ``1/ep`` of the experts whole and the dense
parameters (attention, router, embeddings) as before. ZeRO shards the dense part over the N
data-parallel ranks and the expert part over the ``N / ep`` ranks that hold the same experts, so a
row is the sum of two: the dense parameters over N, and the rank's experts over N / ep (``rows``).
At stage 3 both come to ``Ψ / N``; below it the expert part shrinks by ``ep``.

Traffic per micro-batch and rank (``traffic``): expert parallelism sends each token to its ``k``
experts and back in forward, and the same again in backward: ``4 · L_moe · b · s · k · h · p · (ep-1)/ep``
bytes in all-to-alls. Without it, stage 3 gathers every expert in forward and again in backward,
``2 · Ψ_e · p · (N-1)/N`` bytes received; with it, only the rank's experts over ``N / ep`` ranks.
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace

from .inputs import EstimateError
from .model import ModelInfo
from .stages import Row


def split(info: ModelInfo, ep: int) -> tuple[ModelInfo, ModelInfo]:
    """The dense part of the model and one rank's experts (``1/ep`` of them)."""
    if info.expert_params is None:
        raise EstimateError("ep", "the model has no mixture-of-experts layers zerodp can find (transformers 5's "
                                  "fused experts or zerodp's ExpertParallelMoE); a bare parameter count has none")
    if info.num_experts is not None and info.num_experts % ep:
        raise EstimateError("ep", f"{ep} does not divide the model's {info.num_experts} experts")
    experts = -(-info.expert_params // ep)
    dense = info.params - info.expert_params
    trained_experts = min(info.expert_params, info.trainable_params)
    return (replace(info, params=dense, trainable_params=info.trainable_params - trained_experts),
            replace(info, description=f"1/{ep} of the experts", params=experts,
                    trainable_params=-(-trained_experts // ep), root_unit=0))


def add_rows(a: Row, b: Row) -> Row:
    """Two rows' memory summed (the dense part's row and the experts' row); the rest is ``a``'s."""
    summed = {f.name: getattr(a, f.name) + getattr(b, f.name)
              for f in fields(Row) if f.name in ("parameters", "gradients", "master_weights", "optimizer_states",
                                                 "cpu", "cpu_per_node", "secondary_parameters")}
    return replace(a, **summed)


@dataclass(frozen=True)
class ExpertTraffic:
    """Bytes per micro-batch and rank: the all-to-alls of expert parallelism, and stage 3's expert
    gathers with and without it."""

    all_to_all: int
    gathers_without: int
    gathers_with: int

    @property
    def saving(self) -> int:
        """Stage 3: what expert parallelism saves in bytes moved (negative: it costs more)."""
        return self.gathers_without - self.gathers_with - self.all_to_all


def traffic(info: ModelInfo, ep: int, n: int, micro_batch: int, seq_len: int, p: int) -> ExpertTraffic:
    """See the module docstring; ``n`` data-parallel ranks, ``p`` bytes per element."""
    h = info.transformer.hidden if info.transformer else 0
    k = info.top_k or 1
    exchange = 4 * info.moe_layers * micro_batch * seq_len * k * h * p * (ep - 1) // ep
    experts = info.expert_params or 0
    without = 2 * experts * p * (n - 1) // n
    group = n // ep
    with_ep = 2 * (experts // ep) * p * (group - 1) // group if group > 0 else 0
    return ExpertTraffic(exchange, without, with_ep)
