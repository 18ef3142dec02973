"""Safe memory cleanup for notebooks and scripts: ``gpumem.cleanup(*names)``.

Steps, in order (each one measured):

1. **tracebacks** - clear the local variables of the finished frames pinned by the last error's
   traceback (``sys.last_value`` / ``sys.last_traceback`` / ``sys.last_exc``, IPython's
   ``InteractiveTB.tb`` and ``last_execution_result``, the exception being handled when called in an
   ``except`` block, and every chained ``__cause__`` / ``__context__``).  The traceback objects
   stay, so the error text can still be printed (``%tb``, ``traceback.print_last()``).
2. **output cache** - drop IPython ``Out[N]`` / ``_N`` / ``_`` / ``__`` / ``___`` entries that hold
   tracked tensors.
3. **names** - delete exactly the variables named (caller's globals, then the notebook namespace).
4. **gc** - ``gc.collect()`` for tensors caught in reference cycles.
5. **empty_cache** - return the allocator's free pages to the device, every device in use.

Then it reports what still holds memory.  It never deletes anything unnamed, never raises (problems
go to ``report.problems``), never initialises CUDA, and is idempotent.

Modules: ``api`` (``cleanup()`` and its steps' order), ``report`` (:class:`CleanupReport` and its
text), ``frames`` (tracebacks), ``output_cache`` (IPython's), ``heap`` (which tensors are tracked,
finding them on the gc heap), ``holders`` (who holds the largest ones).
"""
from __future__ import annotations

from .api import cleanup
from .frames import release_tracebacks
from .holders import find_holders
from .report import CleanupReport, Holder, Step

__all__ = ["cleanup", "CleanupReport", "Step", "Holder", "release_tracebacks", "find_holders"]
