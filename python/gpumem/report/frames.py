"""Stack frames as the report shows them: which to leave out, which are Python, whose code it is.

Frames come innermost first, as PyTorch records them (C++ frames, with ``stacks="all"``, before the
Python ones). The *site* of an allocation is the innermost frame of the user's own code: the first
Python frame outside torch and the site packages.
"""
from __future__ import annotations

import os
from typing import Any, Dict, List

__all__ = ["frame_text", "page_frames", "site_of"]

MAX_FRAMES = 40


def frame_text(f: Dict[str, Any]) -> str:
    return f"{f.get('filename', '?')}:{f.get('line', 0)} {f.get('name', '?')}"


# Frames of the interpreter and of the stack gatherer itself, as torch's _memory_viz leaves them out.
_OMIT_NAMES = ("unwind::unwind", "CapturedTraceback::gather", "gather_with_cpp", "_start",
               "__libc_start_main", "PyEval_", "PyObject_", "PyFunction_")
_OMIT_FILES = ("core/boxing", "/Register", "/Redispatch", "pythonrun.c", "Modules/main.c",
               "Objects/call.c", "Objects/methodobject.c", "pycore_ceval.h", "ceval.c", "cpython/abstract.h")
# Python frames inside these are torch's (or gpumem's, or another package's) own, not the user's code
# that allocated. gpumem by its installed folder: a user's project may well be called gpumem.
_GPUMEM_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_LIBRARY_PARTS = ("/torch/", "\\torch\\", "/site-packages/", "/dist-packages/", "<frozen ", _GPUMEM_DIR)


def _keep(f: Dict[str, Any]) -> bool:
    name, filename = str(f.get("name", "")), str(f.get("filename", ""))
    return not any(o in name for o in _OMIT_NAMES) and not any(o in filename for o in _OMIT_FILES)


def _is_python(f: Dict[str, Any]) -> bool:
    return str(f.get("filename", "")).endswith(".py")


def page_frames(frames: List[Dict[str, Any]]) -> List[List[Any]]:
    """[name, filename, line, is_python] for the page, innermost first, interpreter frames left out."""
    out = [[str(f.get("name", "?")), str(f.get("filename", "?")), int(f.get("line", 0) or 0), _is_python(f)]
           for f in frames if _keep(f)]
    return out[:MAX_FRAMES] + ([[f"... {len(out) - MAX_FRAMES} more frames", "", 0, False]]
                               if len(out) > MAX_FRAMES else [])


def site_of(frames: List[Dict[str, Any]]) -> str:
    """The code that asked for a block: the innermost Python frame outside torch and the site
    packages, else the innermost Python frame, else the innermost frame kept."""
    py = [f for f in frames if _is_python(f)]
    user = [f for f in py if not any(p in str(f.get("filename", "")) for p in _LIBRARY_PARTS)]
    pick = user or py or [f for f in frames if _keep(f)]
    return frame_text(pick[0]) if pick else "(no stack recorded)"
