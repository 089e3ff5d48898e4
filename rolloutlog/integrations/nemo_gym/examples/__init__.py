"""Worked examples of what a user writes to attach their own NeMo Gym servers to rolloutlog."""
