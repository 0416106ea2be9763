"""The decode role's room, pure: what a decode rank decides for one request.

`room.py` is the room's state machine (DecodeRoom); beside it, by concept: how a room moves,
decided once its writers are known (`plan.py`), what it expects and what has landed
(`tracker.py`), how a chunk becomes ring pieces (`chunk_pieces.py`), the rank's ring credits
(`credits.py`: who holds which share of its ring) and which writers hear a watermark move
(`watermark_fanout.py`). What both roles share is in transfer/protocol/; nothing here imports
the prefill role's package (an import-linter contract in pyproject.toml).
"""
