"""Optional dependencies, imported only when a feature uses them: torch.

``import gpumem`` must work without torch (and with a CPU-only or broken one), so no module that
``import gpumem`` loads imports torch at its top; they ask here when they need it.  The batch-size
finder, which cannot work without torch, imports it directly and is itself loaded lazily.
"""
from __future__ import annotations

from types import ModuleType
from typing import Optional, Tuple

__all__ = ["import_torch", "torch_or_reason"]


def torch_or_reason() -> Tuple[Optional[ModuleType], str]:
    """``(torch, "")``, or ``(None, "ExceptionType: message")`` when torch cannot be imported (not
    installed, broken, or blocked with ``sys.modules["torch"] = None``)."""
    try:
        import torch
    except Exception as e:  # not installed, or broken
        return None, f"{type(e).__name__}: {e}"
    return torch, ""


def import_torch() -> Optional[ModuleType]:
    """torch, or None when it cannot be imported."""
    return torch_or_reason()[0]
