"""DeepSpeed's ``deepspeed.runtime.sequence_parallel.ulysses_sp``: Ulysses sequence parallelism for
Hugging Face models, as Accelerate, the Transformers Trainer and TRL call it
(``zerodp.parallel.sequence_hf``)."""
from ...parallel.sequence_hf import UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter

__all__ = ["UlyssesSPAttentionHF", "UlyssesSPDataLoaderAdapter"]
