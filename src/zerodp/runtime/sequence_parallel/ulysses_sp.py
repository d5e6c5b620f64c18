"""DeepSpeed's ``deepspeed.runtime.sequence_parallel.ulysses_sp``: Ulysses sequence parallelism for
Hugging Face models, as Accelerate, the Transformers Trainer and TRL call it
(``zerodp.parallel.sequence_hf``), and ALST's tiled MLP and tiled logits-and-loss
(``zerodp.parallel.tiled``)."""
from ...parallel.sequence_hf import UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter
from ...parallel.tiled import SequenceTiledCompute, TiledFusedLogitsLoss, TiledMLP, sequence_tiled_compute

__all__ = ["UlyssesSPAttentionHF", "UlyssesSPDataLoaderAdapter", "TiledMLP", "TiledFusedLogitsLoss",
           "SequenceTiledCompute", "sequence_tiled_compute"]
