"""``python -m gpumem run [--quiet] [--status] [--cupy] [--numba] [--rmm] SCRIPT [ARGS ...]`` and
``... run [OPTIONS] -m MODULE [ARGS ...]``: run an unchanged script with gpumem imported first, so
gpumem is PyTorch's CUDA allocator before the script touches CUDA; ``--cupy`` / ``--numba`` /
``--rmm`` make those libraries allocate from the same pool (docs/integrations.md), exiting 2 with the
``ImportError`` naming the package where one is missing.

This module owns the launcher: parsing the options before SCRIPT (everything from SCRIPT, or from
``-m MODULE``, on belongs to the script, ``--help`` included), checking ``GPUMEM_CONF`` before the
script starts (a bad value exits 2 with the ValueError's message), and running the script as
``python SCRIPT`` / ``python -m MODULE`` would:

* ``sys.argv`` is ``[SCRIPT, ARGS...]`` (for ``-m``, the module's file, as ``python -m`` sets it);
* the script runs as ``__main__`` (``if __name__ == "__main__":`` blocks run), ``__file__`` is its
  absolute path, ``sys.path[0]`` its folder (symlinks resolved); for ``-m``, ``sys.path[0]`` is the
  current folder and the module runs through ``runpy.run_module(alter_sys=True)``;
* exit status: ``sys.exit(n)`` exits n; an uncaught exception prints its traceback (through
  ``sys.excepthook``, without the launcher's frames) and exits 1; KeyboardInterrupt exits 130;
* no signal handler is installed or changed: signals reach the script as they would directly.

``torchrun --no-python gpumem run train.py`` starts it on every rank (the ``gpumem`` script is an
ordinary program; nothing else is needed).
"""
from __future__ import annotations

import argparse
import builtins
import importlib.util
import io
import os
import runpy
import sys
import types
import zipfile
from types import TracebackType
from typing import List, Optional

__all__ = ["add_arguments", "main"]

DESCRIPTION = ("Run an unchanged Python script (or -m MODULE) with gpumem imported first, so gpumem is "
               "PyTorch's CUDA allocator before the script touches CUDA. Everything after SCRIPT (or "
               "after -m MODULE) is passed to the script, even what looks like an option.")

# Frames of these modules are the launcher's, not the script's: left out of a script's traceback.
_LAUNCHER_MODULES = {__name__, "runpy"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options, for ``--help`` and the usage line; :func:`main` parses them itself, since argparse
    cannot stop at the first positional and hand the rest over untouched."""
    p.add_argument("--quiet", action="store_true", help="no gpumem banner (the status line) on stderr")
    p.add_argument("--status", action="store_true",
                   help="print gpumem.status_line() to stderr before the script runs "
                        "(the default unless --quiet)")
    p.add_argument("--cupy", action="store_true", help="CuPy allocates from gpumem's pool too")
    p.add_argument("--numba", action="store_true",
                   help="Numba allocates from gpumem's pool too (NUMBA_CUDA_MEMORY_MANAGER=gpumem.numba)")
    p.add_argument("--rmm", action="store_true", help="RMM (cuDF, cuML) allocates from gpumem's pool too")
    p.add_argument("-m", metavar="MODULE", dest="module",
                   help="run a module as `python -m MODULE` does, instead of SCRIPT")
    p.add_argument("script", nargs="?", metavar="SCRIPT", help="the script to run")
    p.add_argument("args", nargs="*", metavar="ARGS", help="the script's arguments, passed unchanged")


def _parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=DESCRIPTION)
    add_arguments(p)
    return p


def _script_traceback(tb: Optional[TracebackType]) -> Optional[TracebackType]:
    """The traceback from the script's first frame on (the launcher's and runpy's frames dropped)."""
    while tb is not None and tb.tb_frame.f_globals.get("__name__") in _LAUNCHER_MODULES:
        tb = tb.tb_next
    return tb


def _report(e: BaseException) -> None:
    """Prints an uncaught exception as Python would (sys.excepthook), from the script's frames on."""
    e.__traceback__ = _script_traceback(e.__traceback__)  # the hook prints the exception's own
    sys.excepthook(type(e), e, e.__traceback__)


def _set_path0(folder: Optional[str]) -> None:
    """``sys.path[0]`` as ``python SCRIPT`` / ``python -m`` sets it; nothing under ``-P`` (safe_path)."""
    if getattr(sys.flags, "safe_path", False):
        return
    if folder is None:
        if sys.path:
            del sys.path[0]
    elif sys.path:
        sys.path[0] = folder
    else:
        sys.path.insert(0, folder)


def _abs(path: str) -> str:
    """The script's path as Python 3.9+ makes ``__file__``: joined to the current folder, not normalized."""
    return path if os.path.isabs(path) else os.path.join(os.getcwd(), path)


def _run_script(path: str, args: List[str]) -> None:
    full = _abs(path)
    sys.argv = [path, *args]
    if os.path.isdir(full) or zipfile.is_zipfile(full):
        _set_path0(None)  # runpy puts the folder / zip at sys.path[0] itself, as `python DIR` does
        runpy.run_path(path, run_name="__main__")
        return
    # As `python SCRIPT`: a fresh __main__ module that stays in sys.modules (pickling, multiprocessing's
    # spawn and atexit handlers find it), __file__ absolute, sys.argv[0] as given.
    _set_path0(os.path.dirname(os.path.realpath(full)))
    with io.open_code(full) as f:
        code = compile(f.read(), full, "exec", dont_inherit=True)
    main = types.ModuleType("__main__")
    main.__dict__.update(__file__=full, __cached__=None, __builtins__=builtins)
    sys.modules["__main__"] = main
    exec(code, main.__dict__)


def _run_module(module: str, args: List[str]) -> None:
    sys.argv = [module, *args]  # runpy replaces argv[0] with the module's file (alter_sys=True)
    _set_path0(os.getcwd())
    runpy.run_module(module, run_name="__main__", alter_sys=True)


def _split(argv: List[str], parser: argparse.ArgumentParser):
    """(quiet, status, module, script, script_args, integrations): options up to SCRIPT or -m MODULE,
    the rest the script's. Exits 2 with the usage for an unknown option or a missing SCRIPT."""
    quiet = status = False
    integrations: List[str] = []
    i = 0
    while i < len(argv):
        a = argv[i]
        if a == "--":
            i += 1
            break
        if a in ("-h", "--help"):
            parser.print_help()
            raise SystemExit(0)
        if a == "--quiet":
            quiet = True
        elif a == "--status":
            status = True
        elif a in ("--cupy", "--numba", "--rmm"):
            integrations.append(a[2:])
        elif a == "-m" or (a.startswith("-m") and not a.startswith("--")):
            module = a[2:] or (argv[i + 1] if i + 1 < len(argv) else "")
            if not module:
                parser.error("argument -m: expected a MODULE")
            rest = argv[i + 1:] if a != "-m" else argv[i + 2:]
            return quiet, status, module, None, rest, integrations
        elif a.startswith("-") and a != "-":
            parser.error(f"unrecognized option {a!r} before SCRIPT (options for the script go after it)")
        else:
            break
        i += 1
    if i >= len(argv):
        parser.error("the following arguments are required: SCRIPT (or -m MODULE)")
    return quiet, status, None, argv[i], argv[i + 1:], integrations


def _use_integrations(names: List[str]) -> None:
    """--cupy, --numba, --rmm: the libraries allocate from gpumem's pool before the script starts.
    ImportError naming a missing package, RuntimeError when gpumem cannot serve them."""
    for name in dict.fromkeys(names):
        if name == "numba":
            from ._integrations import bridge_for, require

            # Numba reads the variable when the script imports it (child processes inherit it).
            if importlib.util.find_spec("numba") is None:
                require("numba.cuda", "numba-cuda", "gpumem run --numba")
            bridge_for("gpumem run --numba")
            os.environ["NUMBA_CUDA_MEMORY_MANAGER"] = "gpumem.numba"
        else:
            importlib.import_module(f"gpumem.{name}").use()


def main(argv: List[str], prog: str = "python -m gpumem run") -> int:
    """Runs the script; returns its exit status (``sys.exit`` inside it propagates as it would)."""
    parser = _parser(prog)
    quiet, status, module, script, args, integrations = _split(list(argv), parser)
    name = prog

    # gpumem first: torch's allocator before the script can touch CUDA. The command line's own import
    # of gpumem leaves a bad GPUMEM_CONF for here; install() checks it again and raises.
    import gpumem
    from gpumem import _torch

    try:
        _torch.install()
    except ValueError as e:
        print(f"{name}: {e}", file=sys.stderr)
        return 2

    if script is not None:
        if script == "-":
            print(f"{name}: reading the script from stdin is not supported; give a file", file=sys.stderr)
            return 2
        full = _abs(script)
        try:
            if not os.path.isdir(full):
                with open(full, "rb"):
                    pass
        except OSError as e:
            print(f"{name}: can't open file {full!r}: [Errno {e.errno}] {e.strerror}", file=sys.stderr)
            return 2
    else:
        assert module is not None
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            print(f"{name}: No module named {module}", file=sys.stderr)
            return 1

    try:
        _use_integrations(integrations)
    except (ImportError, RuntimeError) as e:
        print(f"{name}: {e}", file=sys.stderr)
        return 2

    if status or not quiet:
        print(gpumem.status_line(), file=sys.stderr, flush=True)

    try:
        if module is not None:
            _run_module(module, args)
        else:
            assert script is not None
            _run_script(script, args)
    except SystemExit:
        raise  # sys.exit(n) in the script: Python turns it into the exit status as it would directly
    except KeyboardInterrupt as e:
        _report(e)
        return 130
    except BaseException as e:
        _report(e)
        return 1
    return 0
