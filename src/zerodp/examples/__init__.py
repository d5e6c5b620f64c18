"""Example models and data sets used by the demos, benchmarks and tests."""

from zerodp.examples.gpt import GPT, GPT_PRESETS, ByteCorpus, GPTConfig, build_gpt

__all__ = ["GPT", "GPTConfig", "GPT_PRESETS", "ByteCorpus", "build_gpt"]
