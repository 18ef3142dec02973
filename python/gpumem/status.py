"""``python -m gpumem status [--watch [SECONDS]] [--json]``: every GPU's used/total memory and its
processes, through NVML.

The library view of ``watch -n 1 nvidia-smi``.  Needs ``nvidia-ml-py`` (``import pynvml``); without it,
without a driver or without GPUs it prints one line saying which is missing and exits 0 (there is
nothing to show, which is no error; never a traceback).  ``--watch`` ends on Ctrl-C with exit 0.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, Dict, List, Optional

from ._format import fmt_bytes

__all__ = ["main", "run", "parser", "add_arguments", "query", "render"]


class StatusError(Exception):
    pass


def _nvml():
    try:
        import pynvml  # provided by nvidia-ml-py
    except Exception as e:
        raise StatusError(f"NVML Python bindings not installed ({type(e).__name__}: {e}); "
                          f"pip install nvidia-ml-py") from None
    return pynvml


def _s(x: Any) -> str:
    return x.decode(errors="replace") if isinstance(x, bytes) else str(x)


def _proc_name(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            parts = [p.decode(errors="replace") for p in f.read().split(b"\0") if p]
        if parts:
            cmd = " ".join([os.path.basename(parts[0]), *parts[1:]])
            return cmd if len(cmd) <= 60 else cmd[:57] + "..."
    except Exception:
        pass
    return "?"


def query(nvml: Any = None) -> List[Dict[str, Any]]:
    """One dict per GPU: index, name, used, total, util, processes [{pid, used, name, kind}]."""
    nv = nvml or _nvml()
    try:
        nv.nvmlInit()
    except Exception as e:
        raise StatusError(f"cannot initialise NVML: {e} (no NVIDIA driver or no GPU?)") from None
    try:
        n = nv.nvmlDeviceGetCount()
        if n == 0:
            raise StatusError("NVML reports no GPUs")
        gpus = []
        for i in range(n):
            h = nv.nvmlDeviceGetHandleByIndex(i)
            g: Dict[str, Any] = {"index": i, "name": "?", "used": None, "total": None, "util": None,
                                 "processes": []}
            try:
                g["name"] = _s(nv.nvmlDeviceGetName(h))
            except Exception:
                pass
            try:
                m = nv.nvmlDeviceGetMemoryInfo(h)
                g["used"], g["total"] = int(m.used), int(m.total)
            except Exception as e:
                g["error"] = f"memory info: {e}"
            try:
                g["util"] = int(nv.nvmlDeviceGetUtilizationRates(h).gpu)
            except Exception:
                pass
            seen = set()
            for kind, fn in (("C", "nvmlDeviceGetComputeRunningProcesses"),
                             ("G", "nvmlDeviceGetGraphicsRunningProcesses")):
                f = getattr(nv, fn, None)
                if f is None:
                    continue
                try:
                    procs = f(h)
                except Exception:
                    continue
                for p in procs or ():
                    pid = int(getattr(p, "pid", -1))
                    if pid in seen:
                        continue
                    seen.add(pid)
                    used = getattr(p, "usedGpuMemory", None)
                    if used is not None and (used < 0 or used >= 2 ** 63):  # NVML_VALUE_NOT_AVAILABLE
                        used = None
                    g["processes"].append({"pid": pid, "used": used, "kind": kind, "name": _proc_name(pid)})
            gpus.append(g)
        return gpus
    finally:
        try:
            nv.nvmlShutdown()
        except Exception:
            pass


def _bar(used: Optional[int], total: Optional[int], width: int = 20) -> str:
    if not used or not total:
        return "[" + " " * width + "]"
    k = max(0, min(width, round(width * used / total)))
    return "[" + "#" * k + "." * (width - k) + "]"


def render(gpus: List[Dict[str, Any]]) -> str:
    lines = []
    for g in gpus:
        used, total = g.get("used"), g.get("total")
        util = f"  util {g['util']:3d}%" if g.get("util") is not None else ""
        mem = f"{fmt_bytes(used)} / {fmt_bytes(total)}" if used is not None and total else "memory n/a"
        lines.append(f"GPU {g['index']}  {g['name']:<28} {_bar(used, total)} {mem}{util}")
        if g.get("error"):
            lines.append(f"    ({g['error']})")
        if not g["processes"]:
            lines.append("    no processes")
        for p in g["processes"]:
            u = fmt_bytes(p["used"]) if p["used"] is not None else "n/a"
            lines.append(f"    pid {p['pid']:>7} {p['kind']} {u:>10}  {p['name']}")
    return "\n".join(lines)


def _seconds(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not v > 0 or v == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r}: seconds must be > 0")
    return v


def _count(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: the count must be >= 1")
    return v


def add_arguments(ap: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The options of ``status``, for its own parser and for ``python -m gpumem status``."""
    ap.add_argument("--watch", "-w", nargs="?", type=_seconds, const=0.0, default=None, metavar="SECONDS",
                    help="refresh every SECONDS (default 1, or -n) until Ctrl-C, like watch nvidia-smi")
    ap.add_argument("-n", "--interval", type=_seconds, default=1.0, metavar="SECONDS",
                    help="seconds between refreshes when --watch gives none (default 1)")
    ap.add_argument("--count", type=_count, default=0, metavar="N",
                    help="stop after N refreshes (implies --watch; for scripts and tests)")
    ap.add_argument("--json", action="store_true",
                    help='machine-readable: one JSON object per refresh, '
                         '{"time": ..., "gpus": [...], "error": null}; without NVML or GPUs "gpus" is '
                         'empty and "error" says why')
    return ap


def parser(prog: str = "python -m gpumem status") -> argparse.ArgumentParser:
    return add_arguments(argparse.ArgumentParser(
        prog=prog, description="GPU memory used/total and processes on every GPU (NVML). Without NVML, "
                               "a driver or a GPU it says so and exits 0."))


def run(args: argparse.Namespace) -> int:
    """Print the status (once, or refreshed while watching); returns the exit code.

    0 also without NVML bindings, driver or GPU (the output says which is missing: there is nothing to
    show, which is no error) and on Ctrl-C while watching; 1 on an unexpected NVML error.
    """
    count = args.count
    watch = args.watch is not None or count > 0
    interval = args.watch or args.interval  # --watch alone (0.0) takes -n's
    n = 0
    try:
        while True:
            error: Optional[str] = None
            gpus: List[Dict[str, Any]] = []
            try:
                gpus = query()
            except StatusError as e:
                error = str(e)
            except Exception as e:  # pynvml errors of any kind
                print(f"gpumem status: NVML error: {type(e).__name__}: {e}", file=sys.stderr)
                return 1
            if args.json:
                out = json.dumps({"time": round(time.time(), 3), "gpus": gpus, "error": error})
            elif error is not None:
                out = f"gpumem status: no GPU to show: {error}"
            else:
                out = render(gpus)
                if watch:
                    if sys.stdout.isatty():
                        sys.stdout.write("\x1b[H\x1b[2J")
                    out = time.strftime("%H:%M:%S") + "\n" + out
            print(out, flush=True)
            n += 1
            # Nothing will appear to watch on a machine without NVML or GPUs: say so once and stop.
            if not watch or error is not None or (count and n >= count):
                return 0
            time.sleep(max(0.05, interval))
    except KeyboardInterrupt:
        return 0
    except BrokenPipeError:
        # The reader went away (``status --watch | head``): stop quietly, without a second error at exit.
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
        except (OSError, ValueError):
            pass
        return 0


def main(argv: Optional[List[str]] = None) -> int:
    """``python -m gpumem status [--watch [SECONDS]] [-n SECONDS] [--count N] [--json]``; returns the
    exit code (argparse's 2 for a bad option, 0 for ``--help``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "status":
        argv = argv[1:]
    try:
        args = parser().parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0)
    return run(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
