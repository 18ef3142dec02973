"""IPython's output cache: ``Out[N]``, ``_N``, ``_``, ``__``, ``___`` and the last results.

IPython keeps every cell's result alive.  :func:`_clear_output_cache` drops IPython's references to
the values a test picks: those that hold tracked tensors (the output-cache step; other outputs stay),
or the one object a user named for deletion.
"""
from __future__ import annotations

import sys
from typing import Any, Callable, Dict, List


def _get_shell() -> Any:
    """The running IPython shell, or None (never imports IPython)."""
    ip_mod = sys.modules.get("IPython")
    if ip_mod is None:
        return None
    try:
        from IPython.core.interactiveshell import InteractiveShell

        if InteractiveShell.initialized():
            return InteractiveShell.instance()
    except Exception:
        pass
    return None


def _clear_output_cache(shell: Any, match: Callable[[Any], bool]) -> List[str]:
    """Drop every output-cache entry whose value ``match``es (``Out[N]``/``_N``, the ``_``/``__``/
    ``___`` that IPython owns, the last execution result); returns the names dropped."""
    dropped: List[str] = []
    if shell is None:
        return dropped
    ns = getattr(shell, "user_ns", {}) or {}
    caches: List[Dict[Any, Any]] = []
    history = getattr(getattr(shell, "history_manager", None), "output_hist", None)
    for c in (ns.get("_oh"), ns.get("Out"), history):
        if isinstance(c, dict) and all(c is not x for x in caches):
            caches.append(c)
    hidden = getattr(shell, "user_ns_hidden", None)
    if not isinstance(hidden, dict):
        hidden = {}
    victims: Dict[int, Any] = {}
    for cache in caches:
        for k in list(cache.keys()):
            v = cache.get(k)
            if match(v):
                victims[id(v)] = v
                del cache[k]
                if f"Out[{k}]" not in dropped:
                    dropped.append(f"Out[{k}]")
                un = f"_{k}"
                if ns.get(un) is v:
                    del ns[un]
                    dropped.append(un)
                if hidden.get(un) is v:
                    del hidden[un]
    dh = getattr(shell, "displayhook", None)
    for u in ("_", "__", "___"):
        v = getattr(dh, u, None) if dh is not None else None
        hit = v is not None and (id(v) in victims or match(v))
        if not hit:
            continue
        if ns.get(u) is v:  # only when IPython owns the name (user did not assign it)
            ns[u] = ""
            dropped.append(u)
        if hidden.get(u) is v:
            hidden[u] = ""
        try:
            setattr(dh, u, "")
        except Exception:
            pass
    for holder in (getattr(dh, "exec_result", None), getattr(shell, "last_execution_result", None)):
        r = getattr(holder, "result", None)
        if holder is not None and r is not None and (id(r) in victims or match(r)):
            try:
                holder.result = None
            except Exception:
                pass
    victims.clear()
    # unique, keep order
    return list(dict.fromkeys(dropped))
