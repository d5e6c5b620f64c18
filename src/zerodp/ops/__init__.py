"""DeepSpeed's ``deepspeed.ops`` names zerodp provides: ``adam`` (``FusedAdam``, ``DeepSpeedCPUAdam``),
``adagrad`` (``DeepSpeedCPUAdagrad``) and ``lion`` (``DeepSpeedCPULion``, ``FusedLion``), each as
torch's optimizer of that kind (Lion, which torch lacks, written here)."""
