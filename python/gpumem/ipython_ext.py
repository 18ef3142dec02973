"""IPython / Jupyter extension: ``%load_ext gpumem``.

* ``%gpumem`` - memory summary.  Subcommands: ``%gpumem plot``, ``%gpumem deltas on|off``,
  ``%gpumem record [SECONDS|stop]``, ``%gpumem timeline on|off|clear``, ``%gpumem quiet on|off``,
  ``%gpumem help``.
* ``%gpumem_cleanup [NAME ...] [--keep-output] [--cpu]`` - :func:`gpumem.cleanup` in the notebook
  namespace, prints the report.
* After any cell that raises an out-of-memory error (``gpumem.is_oom_error``: torch's, gpumem's, a
  cuBLAS/cuDNN allocation failure, or an error chained from one): the frames pinned by the traceback are
  released, garbage collected and the cache emptied, so the memory comes back without a restart.  The
  error text stays visible.
* Optional per-cell memory deltas (``%gpumem deltas on``); every cell adds samples to the session
  timeline that ``gpumem.plot()`` draws.
"""
from __future__ import annotations

import gc
import shlex
import sys
from typing import Any, Optional, Tuple

from ._errors import is_oom_error
from ._format import fmt_bytes
from ._stats import cuda_state, memory_totals, tracked_devices
from .timeline import default_timeline
from .views import summary

__all__ = ["load_ipython_extension", "unload_ipython_extension", "is_oom"]


class _State:
    def __init__(self, ip):
        self.ip = ip
        self.deltas = False
        self.quiet = False
        self.timeline = True
        self.pre: Optional[tuple] = None
        self.last_release: Any = None


_STATE: Optional[_State] = None


# The extension's OOM test is gpumem's one (gpumem.is_oom_error); kept under its old name.
is_oom = is_oom_error


def _totals() -> Tuple[int, int, int]:
    return memory_totals(tracked_devices())


def _count(ip) -> Any:
    return getattr(ip, "execution_count", "?")


def _pre_run_cell(info=None):
    st = _STATE
    if st is None:
        return
    try:
        if cuda_state() != "ready":
            st.pre = None
            return
        st.pre = _totals()
        if st.timeline:
            default_timeline().add(st.pre[0], st.pre[1], label=None)
    except Exception:
        st.pre = None


def release_after_oom(err: BaseException, shell: Any = None):
    """What the extension does after an OOM cell: release the frames the traceback pins, collect,
    empty the cache.  Returns the :class:`gpumem.cleanup.CleanupReport`."""
    from .cleanup import cleanup, release_tracebacks

    release_tracebacks(shell, include_active=False, extra=(err,))
    return cleanup(namespace=getattr(shell, "user_ns", None), output_cache=False, analyze=False)


def _post_run_cell(result=None):
    st = _STATE
    if st is None:
        return
    try:
        err = getattr(result, "error_in_exec", None)
        if err is not None and is_oom_error(err):
            rep = release_after_oom(err, st.ip)
            err = None
            st.last_release = rep
            if not st.quiet:
                if rep.cuda == "ready":
                    print(f"[gpumem] out of memory: released the frames the traceback pinned; "
                          f"allocated {fmt_bytes(rep.allocated_before)} -> {fmt_bytes(rep.allocated_after)}, "
                          f"reserved {fmt_bytes(rep.reserved_before)} -> {fmt_bytes(rep.reserved_after)}. "
                          f"`%gpumem` for a summary, `%gpumem_cleanup` for what still holds memory.")
                else:
                    print("[gpumem] out of memory: released the frames the traceback pinned.")
        if cuda_state() != "ready":
            return
        a, r, p = _totals()
        if st.timeline:
            default_timeline().add(a, r, label=f"[{_count(st.ip)}]")
        if st.deltas and st.pre is not None:
            a0, r0, p0 = st.pre
            peak = f", peak {fmt_bytes(p)}" if p > p0 else ""
            print(f"[gpumem] cell {_count(st.ip)}: allocated {fmt_bytes(a - a0, signed=True)} "
                  f"(now {fmt_bytes(a)}), reserved {fmt_bytes(r - r0, signed=True)} "
                  f"(now {fmt_bytes(r)}){peak}")
    except Exception as e:  # never break the user's session
        try:
            print(f"[gpumem] extension hook failed: {type(e).__name__}: {e}", file=sys.stderr)
        except Exception:
            pass


_HELP = "\n".join([
    "%gpumem                      memory summary (allocated, reserved, peak, fragmentation, largest free "
    "block, cap)",
    "%gpumem plot                 allocated/reserved timeline (one sample per cell, plus any %gpumem record "
    "samples)",
    "%gpumem deltas on|off        print the memory change after every cell",
    "%gpumem record SECONDS|stop  sample the timeline in the background every SECONDS",
    "%gpumem timeline on|off|clear  per-cell timeline samples",
    "%gpumem quiet on|off         silence the message printed after an out-of-memory cell",
    "%gpumem_cleanup [NAME ...] [--keep-output] [--cpu]   gpumem.cleanup() in the notebook namespace",
])


def _onoff(arg: str) -> bool:
    return arg.lower() in ("on", "1", "true", "yes", "")


def gpumem_magic(line: str = ""):
    """%gpumem [plot | deltas on|off | record SECONDS|stop | timeline on|off|clear | quiet on|off | help]"""
    st = _STATE
    try:
        args = shlex.split(line or "")
    except ValueError:
        args = (line or "").split()
    cmd = args[0].lower() if args else ""
    rest = args[1] if len(args) > 1 else ""
    if cmd == "":
        print(summary())
    elif cmd == "help":
        print(_HELP)
    elif cmd == "plot":
        import io

        from .views import plot

        fig = plot()
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=100)
        try:
            from IPython.display import Image, display

            display(Image(data=buf.getvalue(), format="png"))
        except Exception:
            print(f"<figure: {len(buf.getvalue())} bytes PNG>")
    elif cmd == "deltas" and st is not None:
        st.deltas = _onoff(rest)
        print(f"[gpumem] per-cell deltas {'on' if st.deltas else 'off'}")
    elif cmd == "quiet" and st is not None:
        st.quiet = _onoff(rest)
    elif cmd == "timeline" and st is not None:
        if rest.lower() == "clear":
            default_timeline().clear()
        else:
            st.timeline = _onoff(rest)
    elif cmd == "record":
        tl = default_timeline()
        if rest.lower() in ("stop", "off"):
            tl.stop()
            print(f"[gpumem] recording stopped ({len(tl)} samples)")
        else:
            try:
                iv = float(rest) if rest else 0.1
            except ValueError:
                print("usage: %gpumem record SECONDS|stop")
                return None
            tl.start(iv)
            print(f"[gpumem] recording every {iv:g} s; `%gpumem record stop` to stop, `%gpumem plot` to draw")
    else:
        print(f"unknown %gpumem command {cmd!r}\n{_HELP}")
    return None


def gpumem_cleanup_magic(line: str = ""):
    """%gpumem_cleanup [NAME ...] [--keep-output] [--cpu]: gpumem.cleanup in the notebook namespace."""
    from .cleanup import cleanup

    st = _STATE
    ip = st.ip if st is not None else None
    try:
        args = shlex.split(line or "")
    except ValueError:
        args = (line or "").split()
    names = [a for a in args if not a.startswith("--")]
    flags = {a for a in args if a.startswith("--")}
    ns = getattr(ip, "user_ns", None)
    rep = cleanup(*names, namespace=ns, output_cache="--keep-output" not in flags,
                  include_cpu="--cpu" in flags)
    print(rep)
    return None


def load_ipython_extension(ip) -> None:
    """Called by ``%load_ext gpumem``."""
    global _STATE
    if _STATE is not None and _STATE.ip is ip:
        return
    if _STATE is not None:
        unload_ipython_extension(_STATE.ip)
    _STATE = _State(ip)
    ip.register_magic_function(gpumem_magic, "line", "gpumem")
    ip.register_magic_function(gpumem_cleanup_magic, "line", "gpumem_cleanup")
    ip.events.register("pre_run_cell", _pre_run_cell)
    ip.events.register("post_run_cell", _post_run_cell)


def unload_ipython_extension(ip) -> None:
    """Called by ``%unload_ext gpumem``."""
    global _STATE
    for ev, fn in (("pre_run_cell", _pre_run_cell), ("post_run_cell", _post_run_cell)):
        try:
            ip.events.unregister(ev, fn)
        except Exception:
            pass
    try:
        lm = ip.magics_manager.magics["line"]
        for n in ("gpumem", "gpumem_cleanup"):
            lm.pop(n, None)
    except Exception:
        pass
    if _STATE is not None:
        _STATE.pre = None
    _STATE = None
    gc.collect()
