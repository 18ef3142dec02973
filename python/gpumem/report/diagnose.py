"""The report's diagnosis: one paragraph in plain words, computed from the analysed figures.

Sentences come in order of what a user must act on first: out-of-memory errors, memory pinned by a
traceback, who holds the rest, the code holding the most, cache and fragmentation, and what the
snapshot lacks. Each says what to do when there is something to do. Thresholds are stated here once.
"""
from __future__ import annotations

from typing import Any, Dict, List

from .._format import fmt_bytes

__all__ = ["diagnosis"]

MiB = 1 << 20
CACHE_WORTH_SAYING = 0.25  # cached-but-free share of reserved worth a sentence...
CACHE_MIN_BYTES = 64 * MiB  # ...when it is also at least this much
FRAGMENTED = 0.5  # 1 - largest hole / free bytes above which the holes are called fragmented
UNEXPLAINED_SHARE = 0.10  # allocated bytes no Python name reaches, worth a sentence above this share


def _duration(x: float, unit: str) -> str:
    if unit != "us":
        return f"{int(x):,} events"
    s = x / 1e6
    return f"{s:.3g} s" if s < 120 else f"{s / 60:.3g} min"


def _pct(part: float, whole: float) -> str:
    return f"{100.0 * part / whole:.0f}%" if whole else "n/a"


def diagnosis(a: Dict[str, Any]) -> str:
    t, tl, h = a["totals"], a["timeline"], a.get("holders") or {}
    alloc, res = t["allocated"], t["reserved"]
    says: List[str] = []
    problems = 0
    head = f"GPU {a['device']} holds {fmt_bytes(alloc)} allocated and {fmt_bytes(res)} reserved"
    if tl["events"]:
        head += (f"; over the trace ({tl['events']:,} events, {_duration(tl['x'][-1], tl['unit'])}) "
                 f"allocated peaked at {fmt_bytes(tl['peak_allocated'])} and reserved at "
                 f"{fmt_bytes(tl['peak_reserved'])}")
    says.append(head + ".")

    ooms = [m for m in tl.get("markers", []) if m["kind"] == "oom"]
    if tl.get("ooms"):
        problems += 1
        m = ooms[0]
        s = (f"It ran out of memory {tl['ooms']} time{'s' if tl['ooms'] > 1 else ''}; the first time it "
             f"asked for {fmt_bytes(m['bytes'])} with {fmt_bytes(m['allocated'])} allocated and "
             f"{fmt_bytes(m['reserved'])} reserved")
        if m.get("device_free") is not None:
            s += f", {fmt_bytes(m['device_free'])} free on the device"
        if m.get("site") and m["site"] != "(no stack recorded)":
            s += f" (at {m['site']})"
        says.append(s + ": use a smaller batch (gpumem.find_batch_size) or free what the holders below keep.")

    tb = h.get("traceback") or {}
    if tb.get("bytes"):
        problems += 1
        says.append(f"{fmt_bytes(tb['bytes'])} is held by the traceback of the last exception"
                    f"{' (' + tb['exception'] + ')' if tb.get('exception') else ''}: run gpumem.cleanup() "
                    f"to release it.")
    kinds = {k: v for k, v in (h.get("by_kind") or {}).items() if v}
    if kinds:
        parts = [f"{fmt_bytes(v)} {k}" for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])]
        says.append(f"Of the {fmt_bytes(alloc)} allocated, Python objects hold: {', '.join(parts)}.")
    unexplained = h.get("unexplained", 0)
    if h and alloc and unexplained > UNEXPLAINED_SHARE * alloc:
        says.append(f"{fmt_bytes(unexplained)} ({_pct(unexplained, alloc)}) is reachable from no Python "
                    f"name: tensors the autograd graph saved for a backward pass not yet run, or memory "
                    f"held by C++ code or caches.")

    sites = a.get("sites") or []
    if t["stacks_recorded"] and sites and sites[0]["site"] != "(no stack recorded)":
        s0 = sites[0]
        says.append(f"The code holding the most is {s0['site']}: {fmt_bytes(s0['bytes'])} "
                    f"({_pct(s0['bytes'], alloc)} of allocated) in {s0['count']:,} "
                    f"block{'s' if s0['count'] != 1 else ''}.")
    elif alloc:
        says.append("No allocation stacks were recorded: call "
                    "torch.cuda.memory._record_memory_history() before the run to see which code allocates.")

    cached = max(res - alloc, 0)
    if res and cached >= CACHE_WORTH_SAYING * res and cached >= CACHE_MIN_BYTES:
        problems += 1
        says.append(f"{fmt_bytes(cached)} ({_pct(cached, res)}) of the reserved memory is cached but unused: "
                    f"torch.cuda.empty_cache() (gpumem.trim()) returns it to the device for other processes.")
    free = t["free_in_segments"]
    if free >= CACHE_MIN_BYTES and t["fragmentation"] > FRAGMENTED:
        problems += 1
        says.append(f"That free memory is fragmented ({t['fragmentation']:.0%}) into {t['free_blocks']:,} "
                    f"holes; the largest is {fmt_bytes(t['largest_free'])}, so a request above it needs new "
                    f"device memory although {fmt_bytes(free)} is free.")
    if tl["events"] and tl.get("start_allocated"):
        says.append(f"{fmt_bytes(tl['start_allocated'])} was already allocated when the trace begins "
                    f"(memory history started late, or kept only its last events).")
    elif not tl["events"]:
        says.append("The snapshot has no trace, so the timeline is flat: call "
                    "torch.cuda.memory._record_memory_history() before the run to record one.")
    if not problems:
        says.append("Nothing stands out: no out-of-memory error, little cached memory, no fragmentation "
                    "worth acting on.")
    return " ".join(says)
