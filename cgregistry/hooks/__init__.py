"""The plugin manager, the hook specifications, and the events a registry sends through them."""
