"""DeepSpeed's ``deepspeed.ops`` names zerodp provides: ``zerodp.ops.adam``."""
