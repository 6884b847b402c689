"""Weights the graphs read: loading new values into them in place (a weight sync that keeps every graph)."""
