"""The command line (``cgregistry``, ``python -m cgregistry``) and the demo it runs."""

from __future__ import annotations

from cgregistry.cli.commands import main

__all__ = ["main"]
