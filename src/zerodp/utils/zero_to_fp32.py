"""DeepSpeed's ``deepspeed.utils.zero_to_fp32`` functions, for zerodp and DeepSpeed checkpoints
alike, and its command line: ``python -m zerodp.utils.zero_to_fp32 CKPT_DIR OUT_DIR`` (the same
as ``zerodp consolidate``)."""
from __future__ import annotations

import sys

from ..checkpoint.consolidate import (
    consolidate,
    get_fp32_state_dict_from_zero_checkpoint,
    load_state_dict_from_zero_checkpoint,
)

__all__ = ["get_fp32_state_dict_from_zero_checkpoint", "load_state_dict_from_zero_checkpoint",
           "convert_zero_checkpoint_to_fp32_state_dict"]


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir, output_dir, max_shard_size="5GB",
                                               safe_serialization: bool = True, tag=None,
                                               exclude_frozen_parameters: bool = False):
    """Write the checkpoint's full fp32 weights into ``output_dir`` as safetensors (DeepSpeed's
    function of this name; ``safe_serialization=False`` is refused: zerodp writes no pickles)."""
    if not safe_serialization:
        raise ValueError("zerodp writes safetensors only (safe_serialization=True)")
    return consolidate(checkpoint_dir, output_dir, tag=tag, max_shard_size=max_shard_size,
                       exclude_frozen_parameters=exclude_frozen_parameters)


if __name__ == "__main__":
    from ..tools.cli import main
    sys.exit(main(["consolidate", *sys.argv[1:]]))
