"""Where the log records of a Ray actor go. INFO and above go to a file of its own in the run folder. WARNING and above
also go to the actor's stderr, which Ray forwards to the driver's console (the driver starts Ray with log_to_driver, as
slime does). A process without handlers would print warnings only through Python's last-resort handler, into Ray's
session logs, where nobody looks: an engine marked down or restarted, a refused search batch, a failed rollout stream.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_INSTALLED = "_slime_search_actor_handler"  # marks the handlers put in place here, so a second call replaces them


def log_to_run_folder(folder: str | Path, name: str) -> Path:
    """Send this process's log records at INFO and above to `folder/name.log` (appended to: a resumed run keeps the
    earlier lines) and those at WARNING and above to stderr; returns the file. Called once at the start of an actor."""
    path = Path(folder) / f"{name}.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    root = logging.getLogger()
    for handler in [h for h in root.handlers if getattr(h, _INSTALLED, False)]:
        root.removeHandler(handler)
        handler.close()
    to_file = logging.FileHandler(path, encoding="utf-8")
    to_file.setLevel(logging.INFO)
    to_console = logging.StreamHandler(sys.stderr)
    to_console.setLevel(logging.WARNING)
    # Python warnings (a library's fallbacks and deprecations: Megatron without Apex warns on every rank) are kept in
    # the file; the console is for what the run itself reports
    logging.captureWarnings(True)
    to_console.addFilter(lambda record: record.name != "py.warnings")
    for handler in (to_file, to_console):
        handler.setFormatter(logging.Formatter(LOG_FORMAT))
        setattr(handler, _INSTALLED, True)
        root.addHandler(handler)
    if root.level == logging.NOTSET or root.level > logging.INFO:  # the root passes INFO on (a lower level stays)
        root.setLevel(logging.INFO)
    return path
