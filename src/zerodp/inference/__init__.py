"""Streamed inference (ZeRO-Inference): ``zerodp.inference.stream(model, weights)`` runs a model
whose weights stay in safetensors files, each large module's weights brought to the device before
its forward and dropped after (``streamed.py``)."""
from .streamed import DEFAULT_THRESHOLD, StreamedModel, stream

__all__ = ["stream", "StreamedModel", "DEFAULT_THRESHOLD"]
