"""The capability declaration, readable without importing SGLang or torch.

The single source of truth is ``capabilities.json`` shipped inside the package
(and so inside the wheel, at ``sglang_ddtree/capabilities.json``).  A deploy
tool can read it straight from the wheel zip::

    import json, zipfile
    caps = json.loads(zipfile.ZipFile(whl).read("sglang_ddtree/capabilities.json"))
"""

from __future__ import annotations

import json
from functools import lru_cache
from importlib import resources

__all__ = ["load_capabilities", "SUPPORTED_SGLANG_VERSIONS", "MODES"]


@lru_cache(maxsize=1)
def load_capabilities() -> dict:
    text = resources.files(__package__).joinpath("capabilities.json").read_text(encoding="utf-8")
    return json.loads(text)


SUPPORTED_SGLANG_VERSIONS = tuple(load_capabilities()["sglang_versions"])
MODES = tuple(load_capabilities()["modes"])
