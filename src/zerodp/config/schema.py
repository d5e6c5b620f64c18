"""The configuration schema: one pydantic model per DeepSpeed config block, and
:func:`describe_fields`, the documented keys with their defaults."""
from __future__ import annotations

import warnings
from typing import Annotated, Any, ClassVar, Literal, get_args

from pydantic import AfterValidator, BaseModel, BeforeValidator, Field, model_validator

from .compile import CompileConfig
from .fields import (  # noqa: F401 (ConfigError and _fmt are read from here too)
    _NO_AMP,
    _NO_GRAD_OP,
    ConfigError,
    _BatchValue,
    _fmt,
    _int_type,
    _NonNegative,
    _only,
    _Period,
    _Positive,
    _Section,
    _Stage,
)
from .parallel import ExpertParallelConfig, PipelineConfig, TensorParallelConfig, TPSizeConfig  # noqa: F401

__all__ = ["ConfigError", "ZeroConfig", "OptimizerConfig", "SchedulerConfig", "Config", "describe_fields"]

_OFFLOAD_DEVICE = Literal["none", "cpu", "nvme"]


class _OffloadBase(_Section):
    device: _OFFLOAD_DEVICE = Field(
        "none", description='Where the offloaded tensors live: "none", "cpu" (host memory) or "nvme" '
                            '(files under nvme_path).')
    nvme_path: str | None = Field(
        None, description='device "nvme": the directory (on a fast local disk) for the swap files; '
                          "each engine makes its own subdirectory there and removes it when it ends.")
    pin_memory: bool = Field(
        False, description="Page-lock the host buffers that move to and from a GPU, so the copies run "
                           "asynchronously (checked against the host's free memory first); no effect on a CPU device.")
    buffer_count: _Positive = Field(
        4, description="Accepted for compatibility: zerodp keeps two tiles in flight (one read ahead, "
                       "one written back) whatever this says.")
    fast_init: bool = Field(False, description="Accepted for compatibility (no effect).")
    pipeline_read: bool = Field(False, description="Accepted for compatibility: disk reads always run "
                                                   "ahead of the step.")
    pipeline_write: bool = Field(False, description="Accepted for compatibility: disk writes always run "
                                                    "behind the step.")

    @model_validator(mode="after")
    def _nvme_needs_path(self):
        if self.device == "nvme" and not self.nvme_path:
            raise ValueError('allowed: device "nvme" needs nvme_path, a directory on a local disk')
        return self


class OffloadOptimizerConfig(_OffloadBase):
    """``offload_optimizer``: fp32 master weights, optimizer states and the gradient shard the
    step reads live in host memory (``cpu``) or in files (``nvme``); the step runs on the CPU."""

    ratio: float = Field(1.0, description="Fraction of the optimizer offloaded; zerodp offloads all "
                                          "of it, so only 1.0 is allowed.")

    @model_validator(mode="after")
    def _whole(self):
        if self.ratio != 1.0:
            raise ValueError("allowed: ratio 1.0; zerodp offloads the whole optimizer, and a partial "
                             "offload would change what stays on the device")
        return self


class OffloadParamConfig(_OffloadBase):
    """``offload_param`` (stage 3): this rank's parameter shards live in host memory (``cpu``) or
    in files (``nvme``); each unit's shards go to the compute device when the unit is gathered."""

    buffer_count: _Positive = Field(5, description="Accepted for compatibility.")
    buffer_size: _Positive = Field(100_000_000, description="Accepted for compatibility.")
    max_in_cpu: _Positive = Field(1_000_000_000, description="Accepted for compatibility.")



OffloadConfig = OffloadOptimizerConfig  # the name earlier versions exported


class AioConfig(_Section):
    """``aio``: how disk offload reads and writes its swap files."""

    block_size: _Positive = Field(1_048_576, description="Bytes per read or write request of a tile.")
    queue_depth: _Positive = Field(8, description="Requests of one tile in flight at once.")
    thread_count: _Positive = Field(1, description="Accepted for compatibility: zerodp sizes its I/O "
                                                   "threads by queue_depth.")
    single_submit: bool = Field(False, description="Accepted for compatibility (no effect).")
    overlap_events: bool = Field(True, description="Accepted for compatibility (no effect).")
    use_gds: Annotated[bool, _only(False, "GPUDirect Storage is not available")] = Field(
        False, description="Must be false.")


#: The classes DeepSpeed (>= 0.18) makes stage-3 leaves by default: transformers' sparse MoE blocks.
DEFAULT_LEAF_CLASSES = (
    "transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
    "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
    "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock",
)


def _as_list(value: Any) -> Any:
    return [value] if isinstance(value, str) else value


_Names = Annotated[list[str], BeforeValidator(_as_list), AfterValidator(lambda v: list(dict.fromkeys(v)))]


class LeafModuleConfig(_Section):
    """The ``zero_optimization.leaf_module`` block (DeepSpeed >= 0.18): stage-3 leaf modules, each
    gathered and reduced whole as one unit (mixture-of-experts blocks, whose ranks run different
    experts). See docs/training.md."""

    classes: _Names = Field(
        default_factory=lambda: list(DEFAULT_LEAF_CLASSES),
        description="Stage 3: modules of these classes (class names, plain or fully qualified) are leaves. The "
                    "default names the sparse MoE blocks of transformers' Mixtral, Qwen2-MoE and Qwen3-MoE, as "
                    "DeepSpeed's does; a class no module has is skipped.")
    names: _Names = Field(default_factory=list, description="Stage 3: the modules with these names (as "
                                                            "named_modules() gives them) are leaves.")
    name_suffixes: _Names = Field(default_factory=list, description="Stage 3: every module whose name ends with "
                                                                    "one of these is a leaf.")


class ZeroConfig(_Section):
    """The ``zero_optimization`` block."""

    stage: _Stage = Field(0, description="ZeRO stage: 0 = plain data parallel, 1 = shard optimizer states, "
                                         "2 = also shard gradients, 3 = also shard parameters.")
    reduce_bucket_size: _Positive = Field(
        500_000_000, description="Elements per gradient reduce bucket. Parameters are laid out in flat groups of at "
                                 "most this many elements (a larger parameter gets a group of its own); a group is "
                                 "reduced as soon as all its gradients are ready.")
    allgather_bucket_size: _Positive = Field(
        500_000_000, description="Elements per parameter all-gather bucket. zerodp gathers updated shards per flat "
                                 "group, and flat groups are at most reduce_bucket_size elements, so this is accepted "
                                 "for compatibility.")
    overlap_comm: bool | None = Field(None, description="Overlap gradient communication with backward; "
                                                        "null means false for stages 0-2 and true for stage 3.")
    contiguous_gradients: bool = Field(True, description="Accepted for compatibility: zerodp always collects gradients "
                                                         "into contiguous flat buffers as they are produced.")
    reduce_scatter: bool = Field(True, description="Stages 1-2: reduce gradients by reduce-scatter (true) or by "
                                                   "all-reduce, each rank then keeping its shard (false; same numbers, "
                                                   "twice the gradient traffic).")
    allgather_partitions: bool = Field(
        True, description="Accepted for compatibility: zerodp picks the all-gather form for the backend "
                          "(all_gather_single on NCCL; on gloo one all_to_all_single, an in-place exchange "
                          "between two ranks).")
    stage3_prefetch_bucket_size: _NonNegative = Field(
        50_000_000, description="Stage 3: while a unit computes, all-gather the units expected next (recorded forward "
                                "order; reverse in backward) while the units gathered ahead of it hold at most this "
                                "many elements (the next unit is always allowed); the first units start when the "
                                "forward does, and the last unit of forward, which backward uses next, stays gathered "
                                "between them. 0 disables prefetching.")
    stage3_param_persistence_threshold: _NonNegative = Field(
        100_000, description="Stage 3: a module becomes a unit (gathered before its forward and backward, released "
                             "after) when its parameters not claimed by a unit below it number at least this many "
                             "elements; smaller modules' parameters go with the enclosing unit, and the root unit "
                             "stays gathered from forward to the end of backward.")
    leaf_module: LeafModuleConfig = Field(
        default_factory=LeafModuleConfig, description="Stage 3: leaf modules (classes, names, name_suffixes).")
    stage3_module_granularity_threshold: _NonNegative = Field(
        0, description="Stage 3: every module with at most this many parameters per layer (its parameters over "
                       "the modules with parameters inside it, itself included; containers and modules without "
                       "children never) becomes a leaf, parents first, as in DeepSpeed. 0: off.")
    stage3_max_live_parameters: _NonNegative = Field(
        1_000_000_000, description="Stage 3: prefetching stops where it would bring the gathered parameter elements on "
                                   "a rank above this (units being computed are always gathered; 0: no prefetching).")
    stage3_max_reuse_distance: _NonNegative = Field(
        1_000_000_000, description="Stage 3: after its forward, a unit stays gathered when the recorded order uses it "
                                   "again (later in forward or in backward) before this many elements of other units "
                                   "are gathered, within stage3_max_live_parameters; 0 releases every unit after each "
                                   "use (with prefetching on, all but the last unit of forward: backward uses it "
                                   "next).")
    stage3_gather_16bit_weights_on_model_save: bool = Field(
        False, description="What engine.zero_gather_16bit_weights_on_model_save() returns: whether Accelerate and the "
                           "Trainer's save_model may gather the full weights at stage 3 (without it they save a "
                           "checkpoint instead). save_16bit_model gathers them either way.")
    offload_optimizer: OffloadOptimizerConfig | None = Field(
        None, description="Optimizer offload (stages 1-3): see docs/offload.md.")
    offload_param: OffloadParamConfig | None = Field(
        None, description="Parameter offload (stage 3): see docs/offload.md.")
    sub_group_size: _NonNegative = Field(
        1_000_000_000, description="With optimizer offload: the most elements of this rank's shard the "
                                   "step holds in host memory at once (the tile it walks; a parameter "
                                   "piece larger than this, and with 0 every parameter, is a tile of its own).")
    cpu_offload: bool = Field(False, description='Legacy DeepSpeed switch: true means offload_optimizer '
                                                 '{"device": "cpu"}.')
    mics_shard_size: int = Field(
        -1, description="Hybrid sharding (stages 1-3): shard model states inside groups of this many consecutive "
                        "data-parallel ranks and replicate across the groups (gradients reduce-scattered inside a "
                        "group, then summed across groups once per step; stage 3 gathers inside a group). -1 or "
                        "1: shard over every data-parallel rank.")
    zero_hpz_partition_size: _Positive = Field(
        1, description="ZeRO++ hpZ (stage 3): optimizer states, masters, gradients and the parameters' own "
                       "shards stay sharded over every data-parallel rank; besides them each rank keeps a "
                       "secondary copy of the parameters (their dtype) sharded over groups of this many "
                       "consecutive data-parallel ranks (a node), made by the first gather of a step and "
                       "read by backward's gathers and later micro-batches' within the group; dropped after "
                       "each optimizer step (frozen parameters keep theirs). Costs 2 bytes x parameters / "
                       "this size per rank (16-bit). 1: off. See docs/parallel.md.")

    @model_validator(mode="after")
    def _offload_fits_stage(self) -> "ZeroConfig":
        if self.cpu_offload and self.offload_optimizer is None:
            self.offload_optimizer = OffloadOptimizerConfig(device="cpu")
        if self.optimizer_offload != "none" and self.stage == 0:
            raise ValueError("allowed: offload_optimizer at stages 1-3; stage 0 keeps the optimizer "
                             "whole on every rank (use stage 1 or higher to offload it)")
        if self.param_offload != "none" and self.stage != 3:
            raise ValueError("allowed: offload_param at stage 3 only, where parameters are sharded")
        if self.mics_shard_size > 1 and self.stage == 0:
            raise ValueError("allowed: mics_shard_size at stages 1-3 (stage 0 shards nothing)")
        if self.zero_hpz_partition_size > 1 and self.stage != 3:
            raise ValueError("allowed: zero_hpz_partition_size at stage 3 only (hpZ keeps a secondary copy of "
                             "the parameters' shards, which only stage 3 shards; as in DeepSpeed); for states "
                             "sharded within groups and replicated across them at stages 1-2, use mics_shard_size")
        if self.zero_hpz_partition_size > 1 and self.mics_shard_size > 1:
            raise ValueError("allowed: one of zero_hpz_partition_size (hpZ: states over every rank, a secondary "
                             "parameter copy within groups) and mics_shard_size (MiCS: every state within "
                             "groups, replicated across them), not both")
        if self.mics_shard_size == 0 or self.mics_shard_size < -1:
            raise ValueError(f"mics_shard_size: allowed: -1 (off) or a size >= 1, got {self.mics_shard_size}")
        if self.param_offload != "none" and self.optimizer_offload == "none":
            raise ValueError("allowed: offload_param together with offload_optimizer (the step updates "
                             "the parameter shards where they live, on the host)")
        return self

    @property
    def optimizer_offload(self) -> str:
        """``"none"``, ``"cpu"`` or ``"nvme"``."""
        return "none" if self.offload_optimizer is None else self.offload_optimizer.device

    @property
    def param_offload(self) -> str:
        """``"none"``, ``"cpu"`` or ``"nvme"``."""
        return "none" if self.offload_param is None else self.offload_param.device

    @property
    def overlap_comm_effective(self) -> bool:
        """``overlap_comm`` with DeepSpeed's default applied (on only for stage 3)."""
        return self.stage == 3 if self.overlap_comm is None else self.overlap_comm


class OptimizerConfig(_Section):
    """The ``optimizer`` block: ``{"type": ..., "params": {...}}``."""

    type: str = Field(..., description='Optimizer name, e.g. "AdamW", "Adam", "SGD", "Muon" (Muon\'s keys: the '
                                       '"Muon" section below).')
    params: dict[str, Any] = Field(default_factory=dict, description="Optimizer keyword arguments (lr, betas, ...).")


class SchedulerConfig(_Section):
    """The ``scheduler`` block: ``{"type": ..., "params": {...}}``."""

    type: Literal["WarmupLR", "WarmupDecayLR", "WarmupCosineLR"] = Field(
        ..., description="Learning-rate schedule: WarmupLR, WarmupDecayLR or WarmupCosineLR.")
    params: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments for the schedule.")


class BF16Config(_Section):
    """The ``bf16`` block: bfloat16 compute with fp32 master weights."""

    enabled: bool = Field(False, description="Run forward, backward and gradient communication in bfloat16; "
                                            "each rank keeps fp32 master weights and fp32 optimizer states for its "
                                            "shard.")


class FP16Config(_Section):
    """The ``fp16`` block: float16 compute with fp32 master weights and loss scaling."""

    enabled: bool = Field(False, description="Run forward, backward and gradient communication in float16, "
                                            "with fp32 master weights and loss scaling.")
    auto_cast: bool = Field(False, description="Accepted for compatibility: zerodp always casts floating-point "
                                              "tensor inputs of engine(...) to the compute dtype.")
    loss_scale: float = Field(0.0, ge=0.0, allow_inf_nan=False,
                              description="Static loss scale; 0 means dynamic loss scaling.")
    initial_scale_power: _NonNegative = Field(16, description="Dynamic scaling starts at 2**initial_scale_power.")
    loss_scale_window: _Positive = Field(1000, description="Dynamic scaling doubles the scale after this many "
                                                         "consecutive steps without overflow.")
    hysteresis: _Positive = Field(2, description="Dynamic scaling halves the scale at this many overflows "
                                               "(the count restarts when the scale changes, or after every good "
                                               "step with consecutive_hysteresis); each overflow skips its step.")
    consecutive_hysteresis: bool = Field(False, description="Restore the hysteresis count after every step "
                                                           "without overflow, not only when the scale rises.")
    min_loss_scale: float = Field(1.0, gt=0.0, allow_inf_nan=False,
                                  description="Lowest dynamic scale; an overflow at this scale raises an error "
                                              "instead of skipping steps forever.")


class DataTypesConfig(_Section):
    """The ``data_types`` block."""

    grad_accum_dtype: Literal["fp32", "fp16", "bf16"] | None = Field(
        None, description='Dtype of the gradients kept between backward and step (accumulated over '
                          'micro-batches): null means the compute dtype; "fp32" accumulates 16-bit '
                          'gradients in fp32 (twice the gradient memory).')


class AmpConfig(_Section):
    """The ``amp`` block; only ``enabled: false`` is supported."""

    warn_unknown_keys: ClassVar[bool] = False
    enabled: Annotated[bool, _only(False, _NO_AMP)] = Field(False, description="Apex AMP; must be false (use bf16 or "
                                                                               "fp16).")


class _MonitorBlock(_Section):
    """Where a monitor writes: ``output_path/job_name``."""

    output_path: str = Field("", description="Directory that holds the job's directory; empty means the current "
                                            "working directory.")
    job_name: str = Field("DeepSpeedJobName", description="Name of the run's directory inside output_path "
                                                         "(DeepSpeed's default name).")


class CSVMonitorConfig(_MonitorBlock):
    """The ``csv_monitor`` block: per-step training metrics written to a CSV file by rank 0."""

    enabled: bool = Field(False, description="Write one row of training metrics per optimizer step (loss, learning "
                                            "rate, gradient norm, throughput, memory, communication) to "
                                            "output_path/job_name/metrics.csv, on rank 0 only (see docs/metrics.md).")


class TensorBoardConfig(_MonitorBlock):
    """The ``tensorboard`` block: the same per-step metrics as TensorBoard scalars (rank 0)."""

    enabled: bool = Field(False, description="Write the per-step metrics of csv_monitor as TensorBoard scalars to "
                                            "output_path/job_name on rank 0; needs the tensorboard package "
                                            "(pip install tensorboard).")


class ActivationCheckpointingConfig(_Section):
    """The ``activation_checkpointing`` block: DeepSpeed's settings for
    ``deepspeed.checkpointing``, whose ``checkpoint`` recomputes activations in backward."""

    partition_activations: bool = Field(False, description="Not implemented (warned when true): checkpointed "
                                                           "activations are kept whole on every rank, as torch "
                                                           "keeps them. Same results, more memory.")
    cpu_checkpointing: bool = Field(False, description="Checkpointed layers' inputs wait in host memory from "
                                                       "forward until backward recomputes the layer: those of "
                                                       "deepspeed.checkpointing.checkpoint and of Hugging Face "
                                                       "layers under gradient checkpointing (the Trainer's "
                                                       "gradient_checkpointing), run in the engine's forward.")
    contiguous_memory_optimization: bool = Field(False, description="Not implemented (warned when true); no "
                                                                    "effect on results.")
    number_checkpoints: int | None = Field(None, description="Accepted for compatibility; no effect.")
    synchronize_checkpoint_boundary: bool = Field(False, description="Accepted for compatibility; no effect.")
    profile: bool = Field(False, description="Accepted for compatibility; no effect.")

    @model_validator(mode="after")
    def _warn_unimplemented(self) -> "ActivationCheckpointingConfig":
        on = [k for k in ("partition_activations", "contiguous_memory_optimization")
              if getattr(self, k)]
        if on:
            warnings.warn(f"activation_checkpointing: {', '.join(on)} not implemented: activations are kept as "
                          "torch keeps them (same results, more memory)", UserWarning, stacklevel=2)
        return self


class CheckpointConfig(_Section):
    """The ``checkpoint`` block."""

    tag_validation: Literal["Warn", "Ignore", "Fail", "WARN", "IGNORE", "FAIL"] = Field(
        "Warn", description="Accepted for compatibility: zerodp always checks that every rank saves "
                            "the same tag and fails the save when they differ.")
    async_save: bool = Field(False, description="save_checkpoint returns once this rank's tensors are "
                                                "copied to host memory and writes them in the background "
                                                "(costs host memory equal to the rank's checkpoint file "
                                                "until written); the next save or load waits for it.")
    use_node_local_storage: Annotated[bool, _only(False, "zerodp writes every checkpoint to one "
                                                         "directory all ranks can read (a shared "
                                                         "filesystem)")] = Field(
        False, description="Must be false: every rank writes its own file into one directory that "
                           "all ranks can read.")


class Config(_Section):
    """A whole zerodp config (DeepSpeed key names and defaults)."""

    train_batch_size: _BatchValue = Field(
        None, description='Global batch per optimizer step (integer, "auto" or null). This or '
                          'train_micro_batch_size_per_gpu must be an integer by the time the engine is '
                          'built (as in DeepSpeed); "auto" is for a launcher to fill in.')
    train_micro_batch_size_per_gpu: _BatchValue = Field(
        None, description='Batch per rank per forward/backward (integer, "auto" or null); '
                          'initialize fills it from a DataLoader passed as training_data.')
    gradient_accumulation_steps: _BatchValue = Field(
        None, description='Micro-batches accumulated per optimizer step (integer, "auto" or null).')
    gradient_clipping: float = Field(1.0, ge=0.0, allow_inf_nan=False,
                                     description="Max global gradient L2 norm; 0 disables clipping. The default, "
                                                 "1.0, is DeepSpeed's since 0.19 (before, it was 0).")
    steps_per_print: _Period = Field(10, description="Log progress every this many optimizer steps; infinity "
                                                     "(or null) never.")
    wall_clock_breakdown: bool = Field(False, description="Log the mean forward, backward and step times every "
                                                          "steps_per_print steps (rank 0).")
    comms_timeout_s: Literal["auto", "off"] | Annotated[float, Field(gt=0)] = Field(
        "auto", description="Seconds a rank waits in a collective before it looks at the other ranks' progress "
                            "records: a rank that stopped answering (no heartbeat), or every rank waiting in a "
                            "collective, ends the wait with an error naming the ranks and where each was last "
                            "seen; live ranks elsewhere are waited for (a warning each period) up to 20 periods. "
                            "auto: 5x the slowest step so far, within 30-600 s; off: wait as torch does. Also "
                            "sets the default process group's timeout to 21 periods when a number.")
    seed: int | None = Field(None, description="Stored for compatibility; zerodp does not seed RNGs (every rank starts "
                                               "from rank 0's initial parameters, broadcast at initialize).")
    optimizer: OptimizerConfig | None = Field(
        None, description="Optimizer built by the engine; null if you pass your own.")
    scheduler: SchedulerConfig | None = Field(None, description="Learning-rate scheduler built by the engine.")
    zero_optimization: ZeroConfig = Field(default_factory=ZeroConfig, description="ZeRO settings.")
    tensor_parallel: TensorParallelConfig = Field(default_factory=TensorParallelConfig,
                                                  description="Tensor parallelism (docs/parallel.md).")
    pipeline: PipelineConfig = Field(default_factory=PipelineConfig,
                                     description="Pipeline parallelism (docs/pipeline.md).")
    expert_parallel: ExpertParallelConfig = Field(
        default_factory=ExpertParallelConfig,
        description="Expert parallelism for mixture-of-experts models (DeepSpeed's AutoEP keys; docs/parallel.md).")
    sequence_parallel_size: _Positive = Field(
        1, description="Ulysses sequence parallelism: split each batch's sequence over this many consecutive "
                       "ranks, which attend over the whole sequence for their share of the heads; ZeRO shards "
                       "over data x sequence ranks and batch sizes count the data-parallel ranks alone "
                       "(docs/parallel.md). 1: off.")
    seq_parallel_communication_data_type: Literal["fp32", "fp16", "bf16"] | None = Field(
        None, description="Accepted for compatibility: the sequence-parallel all-to-alls run in the "
                          "activations' dtype; gradients are reduced as communication_data_type says.")
    data_parallel_size: _Positive | None = Field(
        None, description="The data-parallel size DeepSpeed's mesh path reads beside sequence_parallel_size; "
                          "when given it must equal world size / sequence_parallel_size.")
    bf16: BF16Config = Field(default_factory=BF16Config, description="bfloat16 mixed precision.")
    fp16: FP16Config = Field(default_factory=FP16Config, description="float16 mixed precision with loss scaling.")
    communication_data_type: Literal["fp32", "fp16", "bf16"] | None = Field(
        None, description="Dtype in which gradients are reduced across ranks; null means the dtype the "
                          "gradients are kept in (the compute dtype unless data_types.grad_accum_dtype says "
                          "otherwise).")
    data_types: DataTypesConfig = Field(default_factory=DataTypesConfig, description="Gradient accumulation dtype.")
    amp: AmpConfig = Field(default_factory=AmpConfig, description="Apex AMP settings (must stay disabled).")
    gradient_predivide_factor: Annotated[float, _only(1.0, _NO_GRAD_OP)] = Field(
        1.0, description="Must be 1.0 (gradient pre-division is not implemented).")
    prescale_gradients: Annotated[bool, _only(False, _NO_GRAD_OP)] = Field(
        False, description="Must be false (gradient pre-scaling is not implemented).")
    sparse_gradients: Annotated[bool, _only(False, _NO_GRAD_OP)] = Field(
        False, description="Must be false (sparse gradients are not implemented).")
    aio: AioConfig = Field(default_factory=AioConfig, description="Disk offload I/O settings.")
    activation_checkpointing: ActivationCheckpointingConfig = Field(
        default_factory=ActivationCheckpointingConfig,
        description="DeepSpeed's activation checkpointing settings (zerodp.checkpointing).")
    zero_allow_untested_optimizer: bool = Field(
        False, description="Accepted for compatibility: zerodp takes any elementwise torch optimizer and Muon, "
                           "and refuses the others whatever this says.")
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig,
                                         description="Checkpoint saving.")
    csv_monitor: CSVMonitorConfig = Field(default_factory=CSVMonitorConfig,
                                          description="Per-step training metrics in a CSV file.")
    tensorboard: TensorBoardConfig = Field(default_factory=TensorBoardConfig,
                                           description="Per-step training metrics as TensorBoard scalars.")
    compile: CompileConfig = Field(default_factory=CompileConfig,
                                   description="DeepSpeed's engine.compile() settings (DeepCompile's; "
                                               "docs/training.md).")

    @model_validator(mode="before")
    @classmethod
    def _bfloat16_alias(cls, data: Any) -> Any:
        if isinstance(data, dict) and "bfloat16" in data:
            if "bf16" in data:
                raise ValueError('allowed: only one of "bf16" and its alias "bfloat16"')
            data = dict(data)
            data["bf16"] = data.pop("bfloat16")
        return data

    @model_validator(mode="after")
    def _one_precision(self) -> "Config":
        if self.bf16.enabled and self.fp16.enabled:
            raise ValueError('allowed: at most one of "bf16.enabled" and "fp16.enabled"')
        return self

    @property
    def compute_dtype(self) -> str:
        """``"bf16"``, ``"fp16"`` or ``"fp32"``: the dtype of parameters in forward and backward."""
        return "bf16" if self.bf16.enabled else "fp16" if self.fp16.enabled else "fp32"

    # DeepSpeed's ``engine.config`` is the config dict, read by key (``transformers`` reads
    # ``engine.config.get("zero_optimization", {}).get("stage")``): these read the validated
    # config as a dict, defaults filled in.
    def as_dict(self) -> dict[str, Any]:
        """The config as a plain dict of DeepSpeed key names (defaults included)."""
        return self.model_dump(mode="python")

    def get(self, key: str, default: Any = None) -> Any:
        return self.as_dict().get(key, default)

    def __getitem__(self, key: str) -> Any:
        return self.as_dict()[key]

    def __contains__(self, key: object) -> bool:
        return key in self.as_dict()

    @model_validator(mode="after")
    def _warn_unknown(self) -> "Config":
        for path in _unknown_keys(self, ""):
            warnings.warn(f"zerodp ignores unsupported config key '{path}'", UserWarning, stacklevel=2)
        return self


def _unknown_keys(model: BaseModel, prefix: str) -> list[str]:
    paths = []
    if getattr(type(model), "warn_unknown_keys", False):
        paths += [prefix + key for key in (model.model_extra or {})]
    for name in type(model).model_fields:
        value = getattr(model, name)
        if isinstance(value, BaseModel):
            paths += _unknown_keys(value, f"{prefix}{name}.")
    return paths



def _nested_model(annotation: Any) -> type[BaseModel] | None:
    """The config block class inside ``annotation`` (``X`` or ``X | None``), if any."""
    candidates = [annotation, *get_args(annotation)]
    return next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)


def describe_fields(model: type[BaseModel] = Config, prefix: str = "") -> list[tuple[str, str, str]]:
    """``(dotted key, default as JSON text, description)`` for every documented config field."""
    rows = []
    for name, field in model.model_fields.items():
        key = prefix + name
        default = None if field.is_required() else field.get_default(call_default_factory=True)
        nested = _nested_model(field.annotation)
        if nested is not None:
            if default is None:  # optional block: document the block itself, then its keys
                rows.append((key, "null", field.description or ""))
            rows.extend(describe_fields(nested, key + "."))
            continue
        rows.append((key, "required" if field.is_required() else _fmt(default), field.description or ""))
    return rows
