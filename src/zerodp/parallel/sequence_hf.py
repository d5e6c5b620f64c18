"""Ulysses sequence parallelism for Hugging Face models: DeepSpeed's ``UlyssesSPAttentionHF`` and
``UlyssesSPDataLoaderAdapter`` (``deepspeed.runtime.sequence_parallel.ulysses_sp``), which
Accelerate, the Transformers Trainer and TRL call when ``ParallelismConfig(sp_backend="deepspeed")``
asks for sequence parallelism.

* :meth:`UlyssesSPAttentionHF.register_with_transformers` makes the sequence-parallel groups and
  puts a Ulysses wrapper in transformers' attention registry under the model's own implementation
  name (``sdpa``, ``flash_attention_2``, ...), so the model's code paths for that name keep working;
  it returns the ``mpu`` that ``initialize(mpu=...)`` takes (``parallel_state_sp``).
* The wrapper drops the attention mask (a causal core over the whole sequence; a flex attention
  ``BlockMask``, made by the model for this rank's slice, is replaced by a causal one over the whole
  sequence, as DeepSpeed's is) and needs ``position_ids``, which it all-gathers over the group: the
  core sees the whole sequence's positions.
* :class:`UlyssesSPDataLoaderAdapter` wraps a data loader: the ranks of a group each draw a batch,
  exchange them, and serve, one after the other, this rank's slice of every one; labels are
  shifted on the whole sequence first (``shift_labels``, -100 at the end), so no target is lost at
  a slice boundary, and ``labels`` is dropped (the model computes no loss of its own).

How the loss and gradients then come out is in ``sequence.py``: the Trainer's loss (each slice's
mean, weighted by its tokens over the group) gives the one-process gradients.
"""
from __future__ import annotations

import collections
from typing import Any, Callable, Optional

import torch

from ..core.collectives import Comm
from .sequence import STATE, SequenceParallelError, all_to_all, check_heads, initialize_sequence_parallel

_ORIGINAL: dict[str, Callable] = {}  # implementation name -> transformers' own function, before wrapping


class UlyssesSPAttentionHF(torch.nn.Module):
    """A transformers attention function run over the whole sequence for this rank's share of the heads.

    Called as transformers calls an attention function: ``(module, query, key, value, attention_mask,
    *args, **kwargs)`` with ``[batch, heads, local sequence, head dim]`` tensors; returns
    ``(output [batch, local sequence, heads, head dim], weights)``."""

    def __init__(self, attn: Callable, batch_size: int, attn_head_count: int, attn_head_size: int,
                 kv_head_count: int, num_hidden_layers: int, process_group: Any, seq_length_is_variable: bool = False,
                 local_seq_length: Optional[int] = None, global_seq_length: Optional[int] = None,
                 disable_in_eval: bool = False) -> None:
        super().__init__()
        self.attn = attn
        self.comm = Comm(process_group, "sequence")
        self.sp = self.comm.world_size
        self.heads, self.kv_heads, self.head_size = attn_head_count, kv_head_count, attn_head_size
        self.repeat = check_heads(attn_head_count, kv_head_count, self.sp)
        self.batch_size, self.num_hidden_layers = batch_size, num_hidden_layers
        self.seq_length_is_variable = seq_length_is_variable
        self.local_seq_length, self.global_seq_length = local_seq_length, global_seq_length
        self.disable_in_eval = disable_in_eval

    def forward(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: Any, *args: Any, **kwargs: Any):
        if self.disable_in_eval and not module.training:  # evaluation runs whole sequences
            return self.attn(module, query, key, value, attention_mask, *args, **kwargs)
        if kwargs.get("position_ids") is None:
            raise SequenceParallelError(
                "Ulysses sequence parallelism needs position_ids in the batch (the positions of this rank's "
                "slice in the whole sequence): the attention core sees the whole sequence, whose positions "
                "are gathered from every rank; have the collator return them (TRL: it does)")
        if not self.seq_length_is_variable and self.local_seq_length is not None \
                and query.shape[2] != self.local_seq_length:
            raise SequenceParallelError(f"Ulysses: this rank's slice has {query.shape[2]} positions, but the "
                                        f"sequence length was fixed at {self.global_seq_length} "
                                        f"({self.local_seq_length} per rank); pass seq_length_is_variable=True")
        kwargs["position_ids"] = torch.cat(self.comm.all_gather_list(kwargs["position_ids"].contiguous()), dim=1)
        if self.repeat > 1:
            key, value = key.repeat_interleave(self.repeat, dim=1), value.repeat_interleave(self.repeat, dim=1)
        q, k, v = (all_to_all(t, self.comm, 1, 2, what=name)
                   for t, name in ((query, "queries"), (key, "keys"), (value, "values")))
        if attention_mask is not None:  # a flex BlockMask made for the slice: causal over the whole sequence
            attention_mask = self._causal_block_mask(q.shape[0], q.shape[2], q.device)
        groups = getattr(module, "num_key_value_groups", None)
        if groups is not None:  # this rank's heads per key/value head, for the call
            module.num_key_value_groups = q.shape[1] // k.shape[1]
        try:
            out, weights = self.attn(module, q, k, v, attention_mask, *args, **kwargs)  # [b, s, h/sp, d]
        finally:
            if groups is not None:
                module.num_key_value_groups = groups
        return all_to_all(out, self.comm, 1, 2, what="attention output"), weights  # [b, s/sp, h, d]

    def _causal_block_mask(self, batch: int, length: int, device: torch.device) -> Any:
        """flex attention's causal ``BlockMask`` over the whole sequence, made once per shape (the
        model's own was made for this rank's slice)."""
        key = (batch, length, str(device))
        if getattr(self, "_block_mask_key", None) != key:
            from torch.nn.attention.flex_attention import create_block_mask

            def causal(b, h, q_idx, kv_idx):
                return q_idx >= kv_idx

            self._block_mask = create_block_mask(causal, B=batch, H=None, Q_LEN=length, KV_LEN=length, device=device)
            self._block_mask_key = key
        return self._block_mask

    @classmethod
    def register_with_transformers(cls, model_name_or_path: Any, core_attn_implementation: str,
                                   sequence_parallel_size: int, micro_batch_size: int,
                                   seq_length: Optional[int] = None, seq_length_is_variable: bool = True,
                                   disable_in_eval: bool = False, max_length: Optional[int] = None):
        """Make the sequence-parallel groups and wrap transformers' ``core_attn_implementation`` in
        Ulysses (see the module docstring); returns the ``mpu`` for ``initialize`` (None for a size
        of 1, which changes nothing)."""
        if sequence_parallel_size == 1:
            return None
        from transformers import AutoConfig, PreTrainedModel
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        if max_length is not None:
            seq_length = seq_length or max_length
        if not seq_length_is_variable and seq_length is None:
            raise ValueError("register_with_transformers: seq_length_is_variable=False needs seq_length")
        if core_attn_implementation in ("eager", "paged|eager"):
            raise ValueError(f"Ulysses sequence parallelism cannot run attn_implementation "
                             f"'{core_attn_implementation}' (it needs the whole 4-D attention mask); use sdpa, "
                             "flash_attention_2/3 or flex_attention")
        if core_attn_implementation not in ALL_ATTENTION_FUNCTIONS:
            raise ValueError(f"attn_implementation '{core_attn_implementation}' is not one of transformers' "
                             f"attention functions: {sorted(ALL_ATTENTION_FUNCTIONS.valid_keys())}")
        if isinstance(model_name_or_path, PreTrainedModel) or hasattr(model_name_or_path, "config"):
            config = model_name_or_path.config
            impl = getattr(config, "_attn_implementation", None)
            if impl is not None and impl != core_attn_implementation:
                raise ValueError(f"the model runs attn_implementation '{impl}', not '{core_attn_implementation}': "
                                 "load it with the one sequence parallelism wraps")
        else:
            config = AutoConfig.from_pretrained(model_name_or_path)
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        heads = text.num_attention_heads
        head_size = getattr(text, "head_dim", None) or text.hidden_size // heads
        kv_heads = getattr(text, "num_key_value_heads", None) or heads
        initialize_sequence_parallel(sequence_parallel_size)  # the groups (the same ones if made already)
        original = _ORIGINAL.setdefault(core_attn_implementation, ALL_ATTENTION_FUNCTIONS[core_attn_implementation])
        local = seq_length // sequence_parallel_size if seq_length is not None else None
        uattn = cls(original, micro_batch_size, heads, head_size, kv_heads, text.num_hidden_layers,
                    STATE.get_sequence_parallel_group(), seq_length_is_variable=seq_length_is_variable,
                    local_seq_length=local, global_seq_length=seq_length, disable_in_eval=disable_in_eval)
        uattn.core_attn_implementation = core_attn_implementation

        def uattn_wrapper(module, query, key, value, attention_mask, *args, **kwargs):
            mask = attention_mask if core_attn_implementation == "flex_attention" and \
                type(attention_mask).__name__ == "BlockMask" else None  # causal over the whole sequence
            return uattn(module, query, key, value, mask, *args, **kwargs)

        ALL_ATTENTION_FUNCTIONS[core_attn_implementation] = uattn_wrapper
        return STATE


def unregister_from_transformers() -> None:
    """Put transformers' own attention functions back (for a process that trains again without
    sequence parallelism)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    for name, fn in _ORIGINAL.items():
        ALL_ATTENTION_FUNCTIONS[name] = fn
    _ORIGINAL.clear()


class UlyssesSPDataLoaderAdapter:
    """DeepSpeed's data loader adapter for sequence parallelism (see the module docstring): each of
    the ``sp_world_size`` ranks of ``sp_group`` draws a batch from ``dl``; the group exchanges them,
    and every rank serves its slice (``sp_rank``) of each in turn, on the CPU. Batches are dicts of
    ``[batch, sequence]`` tensors with ``input_ids``, ``position_ids`` and ``labels``."""

    def __init__(self, dl: Any, sp_rank: int, sp_group: Any, sp_world_size: int, device: Any) -> None:
        self.dl, self.sp_rank, self.sp_world_size, self.device = dl, sp_rank, sp_world_size, device
        self.comm = Comm(sp_group, "sequence")
        self.iter = iter(dl)
        self.micro_batches: collections.deque = collections.deque()

    def __len__(self) -> int:
        return len(self.dl) * self.sp_world_size

    def __iter__(self) -> "UlyssesSPDataLoaderAdapter":
        return self

    def __next__(self) -> dict:
        if not self.micro_batches:
            self.refill()
        return self.micro_batches.popleft()

    def refill(self) -> None:
        try:
            batch = next(self.iter)
        except StopIteration:
            self.iter = iter(self.dl)  # the next epoch starts afresh
            raise
        for key in ("input_ids", "position_ids", "labels"):
            if key not in batch:
                raise ValueError(f"sequence parallelism: the batch has no '{key}' (the data loader adapter "
                                 "slices input_ids, position_ids and the labels shifted on the whole sequence)")
        everyone = self.comm.all_gather_objects({k: (v.cpu() if torch.is_tensor(v) else v) for k, v in batch.items()})
        for source in everyone:
            length = source["input_ids"].shape[1]
            if length % self.sp_world_size:
                raise ValueError(f"sequence parallelism: a sequence of {length} tokens does not split over "
                                 f"{self.sp_world_size} ranks; pad to a multiple of it (pad_to_multiple_of)")
            labels = torch.nn.functional.pad(source.pop("labels"), (0, 1), value=-100)
            source["shift_labels"] = labels[..., 1:].contiguous()
            chunk = length // self.sp_world_size
            lo = chunk * self.sp_rank
            out = {}
            for k, v in source.items():
                if torch.is_tensor(v):
                    if v.dim() < 2 or v.shape[1] != length:
                        raise ValueError(f"sequence parallelism: '{k}' of shape {tuple(v.shape)} is not "
                                         f"[batch, {length}, ...]; the adapter slices every tensor along the sequence")
                    out[k] = v[:, lo:lo + chunk].contiguous()
                else:
                    out[k] = v
            self.micro_batches.append(out)
