"""What a registry holds: its entries, lazy and failed keys, counters, eviction, the route cache, and the static
inputs and outputs the graphs read and write."""
