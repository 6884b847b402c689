"""Capturing keys: the graph pool, the capture job (one sequence for every path, its mode a value), the background
capture thread and refits, and the memory estimate."""
