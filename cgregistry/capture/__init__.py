"""Capturing keys: the graph pool, the capture job (one sequence for every path, in two pieces), the keys pending
capture between steps and refits, and the memory estimate."""
