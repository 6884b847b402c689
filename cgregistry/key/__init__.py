"""The key: ``BatchDescriptor`` (the only place the key's axes live), the key classes a strategy may not serve, and matching a batch to the
closest key that covers it."""

from __future__ import annotations

from cgregistry.key.descriptor import BatchDescriptor, Padding
from cgregistry.key.matcher import Candidate, Explanation, Match, Matcher, PaddingCap

__all__ = ["BatchDescriptor", "Candidate", "Explanation", "Match", "Matcher", "Padding", "PaddingCap"]
