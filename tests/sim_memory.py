"""A simulated device for the batch-size search's CPU tests: the search, its step runner and the
trainers' loops run for real on a CPU model, only device memory is simulated (a CPU has none to run
out of). Shared by tests/test_batch_size*.py."""
import torch

from gpumem import batch_size as bs


class SimBackend(bs._Backend):
    """peak = curve(size) (+ jitter(size, trials so far)); a trial runs out of memory (a real
    ``torch.OutOfMemoryError``, asking for ``oom_request``) when peak > the bound's target (or the
    limit, unbound).

    live: bytes held before the search. reports_reserved: end() gives the reserved peak (equal to the
    allocated one) as the CUDA backend does, or None, as a backend that cannot tell."""

    def __init__(self, curve, limit, total=None, live=0, jitter=None, reports_reserved=True,
                 oom_request="20.00 MiB"):
        self.device = torch.device("cpu")
        self.curve, self.limit, self.total, self.live = curve, limit, total or limit, live
        self.jitter, self.reports_reserved, self.oom_request = jitter, reports_reserved, oom_request
        self.b, self.ballast, self.begun = None, 0, []

    def peak(self):
        extra = self.jitter(self.b, len(self.begun)) if self.jitter else 0
        return self.curve(self.b) + extra

    def allocated(self):
        return self.live

    def limits(self):
        return self.limit, self.total

    def bound(self, target, limit):
        self.ballast = limit - target  # what the trials may not use, as a cap or a ballast would

    def unbound(self):
        self.ballast = 0

    def begin(self, b):
        self.b = b
        self.begun.append(b)

    def sync(self):
        if self.peak() + self.ballast > self.limit:
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {self.oom_request}.")

    def end(self):
        p = min(self.peak(), self.limit - self.ballast)
        return p, (p if self.reports_reserved else None)
