"""The transformers releases whose continuous batching this plugin is tested against, and the check that says so."""

from __future__ import annotations

import re

import transformers

OLDEST = (5, 17)  # ModelRunner and the paged cache as this plugin reads them first appear here
NEWEST = (5, 24)  # the newest release tested (CI installs it; 5.17 runs on the H200 image)
SUPPORTED = f">={OLDEST[0]}.{OLDEST[1]},<{NEWEST[0]}.{NEWEST[1] + 1}"


class UnsupportedTransformersVersion(RuntimeError):
    """The installed transformers is outside the range this plugin is tested with."""


def release(version: str) -> tuple[int, int]:
    """``"5.24.0.dev0"`` -> ``(5, 24)``: the major and minor numbers of a version string."""
    found = re.match(r"(\d+)\.(\d+)", version)
    if found is None:
        raise UnsupportedTransformersVersion(f"cannot read transformers version {version!r}: expected 'MAJOR.MINOR...'")
    return int(found.group(1)), int(found.group(2))


def check_version(version: str | None = None) -> None:
    """Raise ``UnsupportedTransformersVersion`` unless ``version`` (default: the installed one) is in ``SUPPORTED``."""
    version = transformers.__version__ if version is None else version
    if not OLDEST <= release(version) <= NEWEST:
        raise UnsupportedTransformersVersion(
            f"cgregistry-transformers supports transformers {SUPPORTED} (continuous batching's ModelRunner and paged "
            f"cache as those releases define them); transformers {version} is installed"
        )
