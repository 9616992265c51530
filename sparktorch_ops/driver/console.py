"""Rank lines on the driver's stdout/stderr while runs without a logger are in progress.

With no ``logger=`` and no handler configured for the ``sparktorch_ops`` logger (a plain
script, a notebook), INFO records would be dropped; torchrun prints its ranks' output, so a
run does too: stdout lines to stdout, stderr lines (WARNING) to stderr. A configured handler
(or one anywhere up the logger tree) takes over. The handlers are reference-counted: runs in
several threads share them, and the last one to end removes them.
"""

from __future__ import annotations

import logging
import sys
import threading

PACKAGE_LOGGER = logging.getLogger("sparktorch_ops")


class ConsoleOutput:
    """The console handlers of :data:`PACKAGE_LOGGER`, attached while any run uses them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._users = 0
        self._saved_level = logging.NOTSET
        self._handlers: list[logging.Handler] = []

    def acquire(self) -> bool:
        """Attach the handlers if nothing handles our logger; True when this call uses them."""
        with self._lock:
            if self._users == 0:
                if PACKAGE_LOGGER.hasHandlers():
                    return False
                out = logging.StreamHandler(sys.stdout)
                out.addFilter(lambda record: record.levelno < logging.WARNING)
                err = logging.StreamHandler(sys.stderr)
                err.setLevel(logging.WARNING)
                self._handlers = [out, err]
                for handler in self._handlers:
                    handler.setFormatter(logging.Formatter("%(message)s"))
                    PACKAGE_LOGGER.addHandler(handler)
                self._saved_level = PACKAGE_LOGGER.level
                PACKAGE_LOGGER.setLevel(logging.INFO)
            self._users += 1
            return True

    def release(self) -> None:
        """Detach the handlers once the last run that uses them is over."""
        with self._lock:
            self._users -= 1
            if self._users == 0:
                for handler in self._handlers:
                    PACKAGE_LOGGER.removeHandler(handler)
                self._handlers = []
                PACKAGE_LOGGER.setLevel(self._saved_level)


console = ConsoleOutput()
