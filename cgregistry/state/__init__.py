"""What a graph was captured under and replay compares: serving state (autocast, dtypes, matmul flags), the watched
weights and what the step reaches, the live batch during a step, and debug mode's checks."""
