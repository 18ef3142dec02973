"""A real IPython InteractiveShell for the tests of gpumem.cleanup and the notebook extension
(tests/test_cleanup.py on the CPU, tests/gpu/test_cleanup_gpu.py on CUDA tensors)."""
import gc
import sys

EXTENSION = "gpumem.ipython_ext"


def make_shell():
    """IPython's shell (one per process), its history in memory."""
    from IPython.core.interactiveshell import InteractiveShell
    from traitlets.config import Config

    c = Config()
    c.HistoryManager.hist_file = ":memory:"
    return InteractiveShell.instance(config=c)


def clear_last_error():
    """Forget the last uncaught exception (sys.last_*): it holds its frames, and their tensors."""
    for a in ("last_type", "last_value", "last_traceback", "last_exc"):
        if hasattr(sys, a):
            try:
                delattr(sys, a)
            except Exception:
                pass


def run(sh, code, ok=True):
    """Run `code` as a cell (in the history, as typed); with ok, it must succeed."""
    r = sh.run_cell(code, store_history=True)
    if ok:
        assert r.success, (r.error_before_exec, r.error_in_exec)
    return r


def session(sh, setup):
    """For a fixture: `sh` reset, `setup` run in it; afterwards the extension unloaded, the shell reset,
    the last error forgotten and the garbage collected."""
    sh.reset(new_session=False)
    clear_last_error()
    run(sh, setup)
    yield sh
    if EXTENSION in getattr(sh.extension_manager, "loaded", ()):
        sh.extension_manager.unload_extension(EXTENSION)
    sh.reset(new_session=False)
    clear_last_error()
    gc.collect()
