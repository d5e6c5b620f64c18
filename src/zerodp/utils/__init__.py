"""DeepSpeed's ``deepspeed.utils`` names that zerodp provides (thin faces over zerodp's own code)."""
from __future__ import annotations

from ..checkpoint.consolidate import get_fp32_state_dict_from_zero_checkpoint, load_state_dict_from_zero_checkpoint

__all__ = ["get_fp32_state_dict_from_zero_checkpoint", "load_state_dict_from_zero_checkpoint"]
