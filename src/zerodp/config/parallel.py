"""The config blocks of the parallelisms beside ZeRO: ``tensor_parallel`` (AutoTP), ``pipeline`` and
``expert_parallel`` (AutoEP)."""
from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import Field

from .fields import ConfigError, _NonNegative, _only, _Positive, _Section

__all__ = ["TPSizeConfig", "TensorParallelConfig", "PipelineConfig", "ExpertParallelConfig", "AUTOEP_PRESETS"]


class TPSizeConfig(_Section):
    """``tensor_parallel.tp``: DeepSpeed's older spelling of the tensor-parallel size."""

    tp_size: _Positive = Field(1, description="Tensor-parallel size (the same as autotp_size).")


class TensorParallelConfig(_Section):
    """The ``tensor_parallel`` block (DeepSpeed's AutoTP keys)."""

    autotp_size: _NonNegative = Field(
        0, description="Split the model's layers over this many adjacent ranks (Megatron-style tensor "
                       "parallelism, on torch's DTensor); ZeRO shards over the data-parallel ranks between the "
                       "groups. 0 or 1: off. The model's plan comes from partition_config, its transformers "
                       "tp_plan, or zerodp's plan for the example GPT and GPT-2 (docs/parallel.md).")
    tp: TPSizeConfig = Field(default_factory=TPSizeConfig, description="DeepSpeed's older tp_size block.")
    partition_config: dict[str, Any] | None = Field(
        None, description='Which layers are split: {"layer_specs": [{"patterns": [regex over parameter names], '
                          '"partition_type": "column" | "row" | "skip", "shape": [k, -1] for a weight fused from '
                          'k blocks}]}, as DeepSpeed\'s AutoTP reads it.')
    loss_parallel: bool = Field(
        False, description="Keep the output layer's logits split over the vocabulary (a DTensor) and compute the "
                           "model's cross entropy on the slices (torch's loss_parallel) instead of gathering the "
                           "logits whole; the engine's forward and backward run inside loss_parallel() "
                           "(docs/parallel.md).")
    sequence_parallel: bool = Field(
        False, description="Split the activations between the tensor-parallel layers (norms, dropout, residuals) "
                           "along the sequence (Megatron's sequence parallelism, torch's SequenceParallel); the "
                           "example GPT and transformers' GPT-2, Llama, Mistral, Qwen2 and Qwen3 (docs/parallel.md).")
    dtype: Any = Field(None, description="Accepted for compatibility: the dtype comes from the bf16/fp16 blocks.")
    tp_overlap_comm: bool = Field(False, description="Accepted for compatibility (no effect).")

    @property
    def size(self) -> int:
        """The tensor-parallel size (1: off)."""
        sizes = {s for s in (self.autotp_size, self.tp.tp_size) if s > 1}
        if len(sizes) > 1:
            raise ConfigError(f"tensor_parallel: autotp_size {self.autotp_size} and tp.tp_size {self.tp.tp_size} "
                              "differ; give one")
        return next(iter(sizes), 1)


class PipelineConfig(_Section):
    """The ``pipeline`` block: how a ``zerodp.pipe.PipelineModule`` runs (docs/pipeline.md)."""

    stages: Union[_Positive, Literal["auto"]] = Field(
        "auto", description='Pipeline stages; "auto": the PipelineModule\'s num_stages (a number must equal it).')
    schedule: Literal["GPipe", "1F1B", "Interleaved1F1B"] = Field(
        "1F1B", description="torch.distributed.pipelining's schedule: GPipe (all forwards, then all backwards), "
                            "1F1B (one forward, one backward in the steady state), Interleaved1F1B (1F1B over "
                            "several chunks per stage: a PipelineModule built with virtual_stages >= 2).")
    partition: str = Field("best", description="Accepted for compatibility: the PipelineModule's partition_method "
                                               "decides.")
    seed_layers: bool = Field(False, description="Accepted for compatibility: the PipelineModule's seed_layers "
                                                 "decides.")
    activation_checkpoint_interval: _NonNegative = Field(
        0, description="Accepted for compatibility: the PipelineModule's activation_checkpoint_interval decides.")
    pipe_partitioned: bool = Field(True, description="Accepted for compatibility (no effect).")
    grad_partitioned: bool = Field(True, description="Accepted for compatibility (no effect).")


#: DeepSpeed's AutoEP presets and the transformers model types each is for.
AUTOEP_PRESETS = {"qwen3_moe": ("qwen3_moe",), "qwen3_5_moe": ("qwen3_5_moe", "qwen3_5_moe_text"),
                  "mixtral": ("mixtral",), "deepseek_v2": ("deepseek_v2",), "deepseek_v3": ("deepseek_v3",)}
_OWN_ROUTER = "zerodp routes with the model's own router"


class ExpertParallelConfig(_Section):
    """The ``expert_parallel`` block (DeepSpeed's AutoEP): split a transformers mixture-of-experts
    model's experts over expert-parallel groups at ``initialize`` (``parallel/expert_hf.py``). The
    model's own router picks the experts, so the routing keys must be left to it ("auto")."""

    enabled: bool = Field(False, description="Split the model's experts at initialize.")
    autoep_size: _Positive = Field(
        1, description="Ranks per expert-parallel group (consecutive ranks, each holding experts/autoep_size "
                       "experts whole); ZeRO shards expert parameters over the ranks holding the same experts and "
                       "dense ones over every data-parallel rank. Must divide the world size and the experts.")
    preset_model: Literal["qwen3_moe", "qwen3_5_moe", "mixtral", "deepseek_v2", "deepseek_v3"] | None = Field(
        None, description="The model family (DeepSpeed's presets); checked against the model's model_type. "
                          "null: any transformers model whose experts are one fused module (num_experts and 3-D "
                          "parameters), as transformers 5 builds them.")
    moe_layer_pattern: str | None = Field(None, description="Accepted for compatibility: zerodp finds the fused "
                                                            "experts modules itself.")
    expert_pattern: str | None = Field(None, description="Accepted for compatibility (as moe_layer_pattern).")
    router_pattern: str | None = Field(None, description="Accepted for compatibility: the router stays the "
                                                         "model's own.")
    top_k: Union[Literal["auto"], _Positive] = Field(
        "auto", description='Must be "auto" or the model\'s num_experts_per_tok: ' + _OWN_ROUTER + ".")
    score_func: Literal["auto", "softmax", "sigmoid"] = Field(
        "auto", description="Accepted when auto or what the model's router computes; " + _OWN_ROUTER + ".")
    route_norm: bool | None = Field(None, description="Accepted when null or the model's norm_topk_prob; "
                                                      + _OWN_ROUTER + ".")
    route_scale: Annotated[float, _only(1.0, _OWN_ROUTER)] = Field(1.0, description="Must be 1.0; "
                                                                                     + _OWN_ROUTER + ".")
    expert_tensor_parallel_size: Annotated[int, _only(1, "experts are not split by tensor parallelism in "
                                                         "zerodp")] = Field(1, description="Must be 1.")
    load_balance_coeff: Annotated[Any, _only(None, "the model's own auxiliary loss applies (output_router_logits)")] \
        = Field(None, description="Must be null: the model's own router auxiliary loss applies.")
    use_grouped_mm: bool = Field(True, description="Accepted for compatibility (no effect).")
    disable_triton_grouped_mm: bool = Field(False, description="Accepted for compatibility (no effect).")
    validate_folding_routing: bool = Field(False, description="Accepted for compatibility (no effect).")
    async_split_plan: bool = Field(False, description="Accepted for compatibility (no effect).")
    score_apply: str = Field("auto", description="Accepted for compatibility (no effect).")
    combine_impl: str = Field("auto", description="Accepted for compatibility (no effect).")
    row_weighting_impl: str = Field("auto", description="Accepted for compatibility (no effect).")
    gate_up_impl: str = Field("separate", description="Accepted for compatibility (no effect).")
    comm_backend: str = Field("comm", description="Accepted for compatibility: the exchanges use the "
                                                  "process group's backend.")
    comm_num_sm: int = Field(12, description="Accepted for compatibility (no effect).")
    comm_qp_margin: int = Field(4, description="Accepted for compatibility (no effect).")
    comm_max_tokens_per_rank: int = Field(0, description="Accepted for compatibility (no effect).")
    num_expert_groups: int | None = Field(None, description="Accepted for compatibility: the model's router "
                                                            "applies its own group-limited routing.")
    num_limited_groups: int | None = Field(None, description="Accepted for compatibility (as num_expert_groups).")

    @property
    def size(self) -> int:
        """The expert-parallel size (1: off)."""
        return self.autoep_size if self.enabled else 1
