"""Capturing keys: one entry's capture, the plan-level capturer, the background capture thread and refits, and the
memory estimate."""
