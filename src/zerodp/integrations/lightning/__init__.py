"""zerodp for Lightning: ``ZeroStrategy`` (the Trainer) and ``ZeroFabricStrategy`` (Fabric),
registered on import under DeepSpeed's strategy names with ``zerodp`` in place of ``deepspeed``
(``zerodp``, ``zerodp_stage_1``, ``zerodp_stage_2``, ``zerodp_stage_2_offload``,
``zerodp_stage_3``, ``zerodp_stage_3_offload``, ``zerodp_stage_3_offload_nvme``; Fabric also has
``zerodp_stage_1_offload``), and :func:`convert_zero_checkpoint_to_fp32_state_dict` for one-file
exports. Made for each Lightning that is installed (``flavors.py``): ``unified.py`` for the
``lightning`` package (face ``zerodp.lightning``), ``standalone.py`` for ``pytorch_lightning``
and ``lightning_fabric`` (face ``zerodp.pytorch_lightning``). See docs/lightning.md."""
