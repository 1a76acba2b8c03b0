"""The import hook that serves slime's plugin API when slime is not installed.

`install()` appends a finder to the END of `sys.meta_path`. Python asks it about `slime` only after every other
finder has found nothing, the path finder that would find an installed slime among them. So a real slime always
wins. Asked then, it answers with the package in `slime_search/compat/slime/`, whose submodules
(`slime.utils.types`, ...) the path finder resolves from that package's folder. Nothing is imported until a plugin
imports `slime`; the first time, one log line says where slime's modules come from.

A finder rather than a check of `importlib.util.find_spec("slime")` when plugins load. It costs nothing for plugins that
never import slime. It decides at the first `import slime`, so a slime whose path a plugin's module adds before
importing it still takes precedence.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import logging
import sys
from pathlib import Path

logger = logging.getLogger(__name__)

PACKAGE = "slime"
COMPAT_DIR = Path(__file__).resolve().parent / "slime"
SERVED = ("slime.utils.types", "slime.utils.http_utils", "slime.rollout.sglang_rollout",
          "slime.backends.megatron_utils.cp_utils", "slime.utils.misc")  # fmt: skip


class SlimeCompatFinder(importlib.abc.MetaPathFinder):
    """Finds the compat package for `slime` (only the top-level name: its submodules resolve through its path)."""

    def __init__(self) -> None:
        self.announced = False

    def find_spec(self, fullname, path=None, target=None):
        if fullname != PACKAGE:
            return None
        if not self.announced:
            self.announced = True
            logger.info("slime is not installed: a plugin's %s come from slime_search.compat", ", ".join(SERVED))
        return importlib.util.spec_from_file_location(
            PACKAGE, COMPAT_DIR / "__init__.py", submodule_search_locations=[str(COMPAT_DIR)]
        )


def install() -> None:
    """Add the finder once per process (idempotent)."""
    if not any(isinstance(finder, SlimeCompatFinder) for finder in sys.meta_path):
        sys.meta_path.append(SlimeCompatFinder())


def serves_slime() -> bool:
    """Whether the `slime` imported in this process is this compatibility layer (not a real slime)."""
    module = sys.modules.get(PACKAGE)
    return module is not None and Path(getattr(module, "__file__", "") or "").resolve().parent == COMPAT_DIR
