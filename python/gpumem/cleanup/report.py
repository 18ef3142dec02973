"""The cleanup report: what each step freed, what still holds memory, and its text form.

:class:`CleanupReport` is what ``gpumem.cleanup()`` returns; ``str(report)`` is the text the docs
show (``gpumem.cleanup: freed ...``, the steps, the largest live tensors and who holds them).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import List, Tuple

from .._format import fmt_bytes

__all__ = ["Step", "Holder", "CleanupReport"]


@dataclass
class Step:
    """One step of cleanup and what it freed."""

    name: str
    freed_allocated: int = 0  # CUDA allocated bytes released by this step (all devices)
    freed_reserved: int = 0  # CUDA reserved bytes released by this step
    freed_tensors: int = 0  # bytes of Python-visible tracked tensor storages that died in this step
    detail: str = ""
    seconds: float = 0.0


@dataclass
class Holder:
    """A live tracked tensor storage and who refers to it (names, or a description)."""

    nbytes: int
    device: str
    shape: Tuple[int, ...]
    dtype: str
    refs: List[str]


@dataclass
class CleanupReport:
    """What ``gpumem.cleanup()`` did and found; ``str(report)`` is the text form."""

    cuda: str = "none"  # 'none' | 'uninitialized' | 'ready'
    tracked: str = "cuda"
    devices: List[int] = field(default_factory=list)
    allocated_before: int = 0
    reserved_before: int = 0
    allocated_after: int = 0
    reserved_after: int = 0
    steps: List[Step] = field(default_factory=list)
    cleared: List[str] = field(default_factory=list)
    deleted: List[str] = field(default_factory=list)
    missing: List[str] = field(default_factory=list)
    not_tensors: List[str] = field(default_factory=list)
    holders: List[Holder] = field(default_factory=list)
    explained_bytes: int = 0  # CUDA bytes of storages that Python objects reference
    unexplained_bytes: int = 0  # allocated - explained: autograd graph / C++ / untracked
    problems: List[str] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)
    traceback_text: str = ""

    @property
    def cuda_available(self) -> bool:
        return self.cuda != "none"

    @property
    def freed_allocated(self) -> int:
        return self.allocated_before - self.allocated_after

    @property
    def freed_reserved(self) -> int:
        return self.reserved_before - self.reserved_after

    @property
    def ok(self) -> bool:
        return not self.problems

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["freed_allocated"] = self.freed_allocated
        d["freed_reserved"] = self.freed_reserved
        return d

    def __str__(self) -> str:
        L: List[str] = []
        if self.cuda == "ready":
            devs = ", ".join(f"cuda:{d}" for d in self.devices) or "no device in use"
            L.append(f"gpumem.cleanup: freed {fmt_bytes(self.freed_allocated)} allocated, "
                     f"{fmt_bytes(self.freed_reserved)} reserved ({devs})")
            L.append(f"  allocated {fmt_bytes(self.allocated_before)} -> {fmt_bytes(self.allocated_after)}; "
                     f"reserved {fmt_bytes(self.reserved_before)} -> {fmt_bytes(self.reserved_after)}")
        elif self.cuda == "uninitialized":
            L.append("gpumem.cleanup: CUDA not initialised in this process: nothing on GPU to release.")
        else:
            L.append("gpumem.cleanup: no CUDA device available: nothing on GPU to release.")
        L.append("  steps:")
        for s in self.steps:
            if self.cuda == "ready":
                fr = f"{fmt_bytes(s.freed_allocated):>10} alloc {fmt_bytes(s.freed_reserved):>10} reserved"
            else:
                fr = f"{fmt_bytes(s.freed_tensors):>10} tensors"
            L.append(f"    {s.name:<12} {fr}   {s.detail}".rstrip())
        if self.deleted:
            L.append(f"  deleted: {', '.join(self.deleted)}")
        if self.not_tensors:
            L.append(f"  named but held no {self.tracked} tensors (deleted anyway): "
                     f"{', '.join(self.not_tensors)}")
        if self.missing:
            L.append(f"  not found (skipped): {', '.join(self.missing)}")
        if self.holders:
            L.append(f"  still holding memory (largest live {self.tracked} tensors):")
            for h in self.holders:
                shape = "x".join(str(x) for x in h.shape) if h.shape else "scalar"
                refs = "; ".join(h.refs[:4]) + (f"; +{len(h.refs) - 4} more" if len(h.refs) > 4 else "")
                L.append(f"    {fmt_bytes(h.nbytes):>10}  {h.device:<7} {h.dtype}[{shape}]  {refs}")
        if self.cuda == "ready":
            L.append(f"  explained by Python objects: {fmt_bytes(self.explained_bytes)}; "
                     f"not explained (autograd graph, C++ or other references): "
                     f"{fmt_bytes(self.unexplained_bytes)}")
        for n in self.notes:
            L.append(f"  note: {n}")
        for p in self.problems:
            L.append(f"  problem: {p}")
        return "\n".join(L)

    def __repr__(self) -> str:
        return self.__str__()

    def _repr_pretty_(self, p, cycle):  # IPython display
        p.text(self.__str__())

