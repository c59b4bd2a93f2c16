"""Import heavy libraries in a background thread while the process would otherwise wait.

A simulation's server waits ~10 s for Ray and the clients before it builds the first model
(torchvision: 1-6 s to import on a busy 2-core machine), and a client waits while the server
builds it before its first evaluation (torchvision for the model, scikit-learn for the metrics).
Importing them meanwhile hides that time.  Imports only (no model is built, no random number is
drawn), once per process; a failure is left for the real import to report.
"""

from __future__ import annotations

import importlib
import threading

_STARTED: set[str] = set()


def libraries_for(model: str, metrics: bool = False) -> list[str]:
    """The heavy modules the first use of ``model`` (and of the metrics) will import."""
    from .models import VIT_ARCHS

    return (["timm"] if model in VIT_ARCHS else ["torchvision"]) + (["sklearn.metrics"] if metrics else [])


def preload(modules: list[str]) -> threading.Thread | None:
    """Start importing ``modules`` (those not started before in this process) in a daemon thread."""
    todo = [m for m in modules if m not in _STARTED]
    if not todo:
        return None
    _STARTED.update(todo)

    def run() -> None:
        for name in todo:
            try:
                importlib.import_module(name)
            except Exception:  # noqa: BLE001 - the real import names the problem
                pass

    thread = threading.Thread(target=run, name="fedderm-preload", daemon=True)
    thread.start()
    return thread
