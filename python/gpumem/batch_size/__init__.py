"""Find the largest batch size that really fits on the GPU: fast, proven, and without a trace.

    >>> import torch, gpumem
    >>> model = MyNet().cuda()
    >>> res = gpumem.find_batch_size(model, (3, 224, 224), autocast=torch.bfloat16)
    >>> res.batch_size
    412
    >>> print(res)          # one-line summary
    >>> plan = gpumem.find_batch_size(model, (3, 224, 224), target_batch=1024)
    >>> plan.micro_batch_size, plan.accumulation_steps
    (342, 3)

How it works
------------
A *trial* at batch size ``B`` runs ``steps`` real steps (default 3: forward, loss,
backward, optimizer step including the creation of the optimizer state) starting
from an emptied allocator cache and without cuBLAS's workspaces, exactly as a fresh
training process would.  While it runs, the process is capped at ``target`` bytes
(``torch.cuda.set_per_process_memory_fraction``; the fraction it had comes back
afterwards), the budget (``max_memory``, at most the allocator's limit: free device
memory plus what torch already reserved, capped by the fraction) less the safety
``margin``.  A trial passes when no out-of-memory error happened, so a pass proves
the step fits under a cap at the budget with ``margin`` to spare, fragmentation,
workspaces and optimizer-state creation included.  (An allocator plugged into torch
other than gpumem may ignore the fraction: there a *ballast* tensor takes
``limit - target`` bytes instead.)

The search (:func:`_search`, pure and torch-free in its logic) measures peaks at a
few small batch sizes, fits ``peak = fixed + per_sample * B``, predicts the largest
size under the target, proves it with a trial and refines with a short bracketed
search around the prediction (a first guess that leaves the allocator's pages 1 % of the
target, doubled after each failure, then bisection up to the size whose allocated bytes
alone exceed the target).  Peaks are read through ``torch.cuda`` statistics, so it works with
gpumem's allocator registered or with PyTorch's own.

Nothing is left behind: parameters, buffers, optimizer state, gradients, the
modules' train/eval flags and the RNG states are restored bit for bit, and the
allocator cache is emptied at the end so memory reserved afterwards is no more than
before the call.

Modules: ``api`` (:func:`find_batch_size`, argument checks, the budget), ``search`` (the fit, the
search, the accumulation plan; torch-free), ``verify`` (the measured margin and the final
verification; torch-free), ``trial`` (the step runner, default input and loss, generation),
``backend`` (memory backends and the trials' cap), ``state`` (the state guard), ``distributed`` (agreement
across ranks), ``results`` (what it returns and raises), ``lengths`` (sequence length: the largest
length, the token frontier), ``decorator`` (the OOM-retry decorator), ``lightning`` (the Lightning
callback), ``hf`` (Hugging Face ``Trainer``).
"""
from __future__ import annotations

# Internals that tests (tests/test_batch_size.py) drive directly, by their former module-level names.
from .._errors import requested_bytes as _requested_bytes  # noqa: F401
from .api import _find as _find
from .api import _model_device as _model_device
from .api import find_batch_size
from .backend import _Backend as _Backend
from .backend import _CudaBackend as _CudaBackend
from .decorator import find_executable_batch_size
from .lengths import TokenFrontier, find_max_length, find_token_frontier
from .results import BatchSizeError, BatchSizeResult, Trial
from .search import _is_oom as _is_oom
from .search import _plan as _plan
from .search import _search as _search

__all__ = ["find_batch_size", "find_max_length", "find_token_frontier", "TokenFrontier",
           "find_executable_batch_size", "BatchSizeResult", "Trial", "BatchSizeError"]
# Not imported here (they import Lightning / transformers): .lightning (BatchSizeFinder,
# scale_batch_size) and .hf (find_trainer_batch_size); gpumem.<name> imports them when first used.
