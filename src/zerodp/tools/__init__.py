"""The commands: ``zerodp train | estimate | plot | consolidate | generate`` (``cli``) and what
they run (``train``, ``estimate``, ``plot``, ``monitor``, ``generate``)."""
