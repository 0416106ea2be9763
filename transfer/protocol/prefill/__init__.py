"""The prefill role's room, pure: what a prefill rank decides for one request.

`room.py` is the room's state machine (PrefillRoom); beside it, by concept: its flows towards
each decode rank and their states (`flows.py`, their timers `flow_timers.py`), the writes of one
chunk (`chunk_writes.py`), the rank's ring credits and how a chunk is cut to fit them
(`credits.py`), the caller's input, its rules and layer-wise units (`layer_sends.py`)
and the direct path's self-sizing writes (`write_batching.py`). What both roles share (messages,
tags, actions, lifecycle tables, the room base) is in transfer/protocol/; nothing here imports
the decode role's package (an import-linter contract in pyproject.toml).
"""
