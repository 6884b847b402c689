"""The examples as modules, for tests that drive their engines: each loaded once per process, so that an example's
import-time registration (the Hugging Face examples register their attention function) happens once."""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

EXAMPLES = Path(__file__).parent.parent / "examples"


def load_example(filename: str) -> types.ModuleType:
    """``examples/<filename>`` as the module ``<stem>_example`` (the one loaded before, if any), also known as
    ``<stem>``: an example that imports another by its plain name (``import hf_llama``) gets the same module, never
    a second copy (whose custom ops, registered again under the same names, would replace the first copy's)."""
    stem = Path(filename).stem
    name = f"{stem}_example"
    if name in sys.modules:
        return sys.modules[name]
    plain = sys.modules.get(stem)
    if plain is not None and Path(getattr(plain, "__file__", "") or "").resolve() == (EXAMPLES / filename).resolve():
        sys.modules[name] = plain  # imported by another example first
        return plain
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / filename)
    assert spec is not None and spec.loader is not None, filename
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    sys.modules.setdefault(stem, module)
    spec.loader.exec_module(module)
    return module
