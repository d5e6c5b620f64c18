"""Adapters that let other frameworks drive zerodp: each uses only the engine's public API
(``zerodp.initialize``, ``zerodp.zero``, the engine's DeepSpeed-named methods).

- ``lightning/``: strategies for Lightning's ``Trainer`` and ``Fabric`` (public face:
  ``zerodp.lightning``).
"""
