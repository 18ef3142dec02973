"""Under memory pressure: the lowest cap at which each allocator runs each workload without an OOM.

    python bench/pressure.py [--workloads moe,bert] [--allocators native,expandable,gpumem] [--quick]
                             [--repeats 3] [--passes 2] [--json OUT.json] [--jobs 8] [--budget-s 420]
                             [--resume EARLIER.json] [--release-slack S] [--bound device] [--dry-run]
                             [--device cpu]

For each workload (bench/pressure_workloads.py: the kit's allocfree, varlen and resnet rewritten here,
vit, and four whose shapes change every step: moe, bert, generate, ckpt) and each allocator (native,
expandable, async; gpumem = its defaults, release:lazy,stitch:true; gpumem_nostitch =
release:lazy,stitch:false, the defaults before stitching; gpumem_hw = release:high_water,stitch:false;
rmm where RAPIDS RMM imports), one process per run:

 1. uncapped, alone (timed): native first, whose peak allocated bytes (of its first pass) are P; then
    the others. Each gives its step times and max reserved / max allocated; --repeats R runs each R
    times, interleaved across the allocators, and shows the median step times;
 2. capped at 1.05 P, alone (timed, R times likewise): the step times under pressure, and the first
    point of the search (decided by the first pass's OOMs);
 3. the lowest cap k (in units of P, set with torch.cuda.set_per_process_memory_fraction(k P / total))
    at which the whole run has 0 OOM steps, to --tolerance (0.25% of P): rounds of trials in parallel
    on the same GPU (caps are per process; the trials' caps plus each one's CUDA context stay under
    90% of the device), every allocator's unfinished search in the same round, each split into as many
    points as the round has room for. A trial ends at its first OOM. One that met a device short of
    memory (not its cap) while other trials ran beside it runs again alone. Past --budget-s seconds
    no new round starts: the searches left report their bracket, and a later call with --resume (this
    call's --json) goes on from it, keeping P, the timed runs and every trial. A trial runs the step
    list once.

What is timed. Every workload's shapes change from step to step, so each step of a run's first pass
over its step list meets its shapes for the first time and pays their one-time costs (cuBLAS
heuristics, kernels loaded for each new shape, workspaces), which are no allocator's: on an H100
(the step list run three times in one process) varlen's first pass cost 120-168 ms/step, varying
from run to run whatever the allocator, the later passes 35-43 ms/step with every allocator. The
timed runs therefore run the step list --passes times (default 2) in one process: the first pass's
mean step time is "ms free" / "ms @1.05" (as before); the later passes', which meet the same shapes
again as the epochs of a real run do, "ms free st" / "ms @1.05 st" (steady): what the allocator
costs per step once the shapes repeat. Both are shown, each with its ratio (to the best PyTorch
allocator's uncapped, to expandable_segments' at 1.05x), and the steady pass's device calls per
step at 1.05x (num_device_alloc + num_device_free: the remapping left at steady state; none for
async and rmm, whose statistics do not count them). OOM steps are counted per pass; only the first
pass's decide a cap (the lowest passing cap is defined by one pass over the steps).

What a cap bounds. set_per_process_memory_fraction bounds the device memory that torch's own allocators
and gpumem reserve; PyTorch's cudaMallocAsync backend checks it against the bytes torch hands out
only, and the driver's pool under it may reserve more (the res/cap column: its highest max reserved /
cap over its passing runs). --bound device bounds the device itself instead, the same for every
allocator: each capped run leaves its allocator the cap's bytes of the device and takes the rest with
a ballast of its own (bench/pressure_workloads.py: after one unmeasured pass over the steps), one
trial at a time.

Step times to 1%: runs of one allocator a minute apart can differ by more than that (the host's speed
drifts), so bench/lockstep.py compares allocators whose processes take turns, pass by pass, instead.

Prints a table (caps, step times, ratios to the best PyTorch allocator) and, with --json, writes every
figure and trial (each timed run's figures in the rows' ``*_runs`` lists, each worker's whole result,
its steady peaks included, in ``trials``). --dry-run prints the plan and runs nothing; --device cpu
runs each workload's code, tiny, on the CPU (no allocator, no cap; its passes too): the path CI
covers. Every run of a chosen subset fits one GPU call of ~8 minutes on an H100 when it holds three
workloads (the lead runs it in 2-3 calls; a timed run's second pass adds its steps again at the
steady rate, about a second, and the timed runs' time comes out of --budget-s).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "pressure_workloads.py")
sys.path.insert(0, HERE)
from pressure_workloads import (  # noqa: E402  (imports no torch)
    ALLOCATORS, CONTEXT_BYTES, WORKLOADS, is_allocator, release_slack_arg,
)

TORCH_ALLOCATORS = ("native", "expandable", "async")
TIMED_CAP = 1.05
FLOOR = 0.97          # the search's lowest cap: an allocator that runs below P is reported as "<= 0.97"
DEVICE_SHARE = 0.90   # the parallel trials' caps and contexts stay under this share of the device


# ----------------------------------------------------------------------------- the search


@dataclass
class Search:
    """The lowest passing cap of one (workload, allocator), from trials' pass/fail; pure bookkeeping."""
    tolerance: float
    ceiling: float                      # no cap above this is tried (the device's memory)
    floor: float = FLOOR
    trials: dict = field(default_factory=dict)  # cap -> passed

    def record(self, cap: float, passed: bool) -> None:
        self.trials[round(cap, 5)] = passed

    def bracket(self):
        """(highest failing cap below the lowest passing one or None, lowest passing cap or None)."""
        passing = [k for k, ok in self.trials.items() if ok]
        hi = min(passing) if passing else None
        failing = [k for k, ok in self.trials.items() if not ok and (hi is None or k < hi)]
        return (max(failing) if failing else None), hi

    def non_monotone(self) -> bool:
        """A cap that failed above one that passed: the run's outcome is not monotone in the cap."""
        _, hi = self.bracket()
        return hi is not None and any(not ok and k > hi for k, ok in self.trials.items())

    def done(self) -> bool:
        lo, hi = self.bracket()
        if hi is None:
            return lo is not None and lo >= self.ceiling
        if lo is None:
            return hi <= self.floor
        return hi - lo <= self.tolerance + 1e-9

    def propose(self, m: int) -> list:
        """Up to `m` (>= 1) caps to try next, each untried: an (m+1)-way split of the bracket, or points
        towards the side not yet bounded."""
        lo, hi = self.bracket()
        if self.done():
            return []
        if hi is None:  # nothing passed yet: climb from the highest failure (or the floor), doubling the step
            k = self.floor if lo is None else lo
            points, step = [], max(0.05, k * 0.05)
            while len(points) < m and k < self.ceiling:
                k = min(self.ceiling, k + step)
                points.append(k)
                step *= 2
        elif lo is None:  # nothing failed below the lowest pass: the floor, then between
            points = [self.floor] + [self.floor + (hi - self.floor) * j / m for j in range(1, m)]
        else:
            points = [lo + (hi - lo) * j / (m + 1) for j in range(1, m + 1)]
        out = []
        for k in points:
            k = round(k, 4)
            if k not in self.trials and k not in out and (hi is None or k < hi) and (lo is None or k > lo):
                out.append(k)
        if not out and lo is not None and hi is not None:  # 4-digit points all tried: the midpoint
            out = [round((lo + hi) / 2, 5)]
        return out

    def result(self) -> dict:
        lo, hi = self.bracket()
        return dict(lowest_cap=hi, highest_failing=lo, converged=self.done(), non_monotone=self.non_monotone(),
                    trials={f"{k:.4f}": ok for k, ok in sorted(self.trials.items())})


# ----------------------------------------------------------------------------- running trials


def worker_env() -> dict:
    """The environment a worker (bench/pressure_workloads.py) starts with, here and in bench/lockstep.py:
    one OpenMP thread (workers side by side do not oversubscribe the CPU) and unbuffered output."""
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


@dataclass
class Trial:
    workload: str
    allocator: str
    cap: float | None                  # in units of P; None: uncapped
    stop_on_oom: bool
    passes: int = 1                    # the timed runs' --passes; a search trial runs the steps once
    result: dict | None = None


class Runner:
    """Starts workers (bench/pressure_workloads.py), alone or several at once under a memory budget."""

    def __init__(self, args):
        self.args = args
        self.peak = {}    # workload -> P (native's uncapped peak allocated bytes)
        self.total = 0    # the device's memory, from the first run
        self.log = []     # every trial's result, for the JSON output

    def command(self, t: Trial) -> list:
        cmd = [sys.executable, WORKER, t.workload, t.allocator if self.args.device == "cuda" else "none",
               "--device", self.args.device]
        if self.args.device == "cpu":
            cmd.append("--tiny")
        if self.args.quick:
            cmd.append("--quick")
        if t.cap is not None:
            cmd += ["--fraction", f"{self.fraction(t):.8f}"]
        if t.stop_on_oom:
            cmd.append("--stop-on-oom")
        if t.passes > 1:
            cmd += ["--passes", str(t.passes)]
        if self.args.release_slack is not None and t.allocator == "gpumem_hw" and self.args.device == "cuda":
            cmd += ["--release-slack", str(self.args.release_slack)]
        if t.cap is not None and self.args.bound == "device":
            cmd += ["--bound", "device"]
        return cmd

    def ceiling(self, workload: str) -> float:
        """The highest cap a search of `workload` tries, in units of its P: the share of the device the
        trials may take."""
        return DEVICE_SHARE * self.total / self.peak[workload]

    def fraction(self, t: Trial) -> float:
        return min(1.0, t.cap * self.peak[t.workload] / self.total)

    def cap_bytes(self, t: Trial) -> int:
        return int(self.fraction(t) * self.total) if t.cap is not None else self.total

    def _start(self, t: Trial):
        return subprocess.Popen(self.command(t), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=worker_env())

    def _finish(self, t: Trial, proc) -> None:
        out, err = proc.communicate()
        line = next((x for x in reversed(out.splitlines()) if x.startswith("{")), None)
        if proc.returncode != 0 or line is None:
            tail = (err or out).strip().splitlines()[-3:]
            t.result = dict(error=" | ".join(tail) or f"exit {proc.returncode}", ooms=None)
        else:
            t.result = json.loads(line)
        self.log.append(dict(t.result, workload=t.workload, allocator=t.allocator, cap=t.cap))

    def alone(self, t: Trial) -> dict:
        self._finish(t, self._start(t))
        return t.result

    def parallel(self, trials: list) -> None:
        """Runs the trials, as many at once as --jobs and the device's memory allow; a trial that met
        a device short of memory while others ran beside it runs again alone (one that ran alone,
        as every trial under --bound device does, met the device's end itself: its result stands)."""
        budget = DEVICE_SHARE * self.total
        queue, running, retry = list(trials), [], []
        shared = set()  # ids of the trials that ran while another one did
        while queue or running:
            used = sum(self.cap_bytes(t) + CONTEXT_BYTES for t, _ in running)
            while queue and len(running) < self.args.jobs and (
                    not running or used + self.cap_bytes(queue[0]) + CONTEXT_BYTES <= budget):
                t = queue.pop(0)
                running.append((t, self._start(t)))
                used += self.cap_bytes(t) + CONTEXT_BYTES
                if len(running) > 1:
                    shared.update(id(r) for r, _ in running)
            time.sleep(0.2)
            for t, proc in [r for r in running if r[1].poll() is not None]:
                running.remove((t, proc))
                self._finish(t, proc)
                if t.result.get("device_short") and id(t) in shared:
                    retry.append(t)
        for t in retry:
            self.alone(t)


def passed(result: dict) -> bool:
    return result.get("error") is None and result.get("ooms") == 0


def note_reserved_over_cap(row: dict, t: Trial, runner: Runner) -> None:
    """Keeps in the row the highest max reserved / cap bytes of the allocator's passing capped runs:
    above 1 where the allocator held more of the device than the cap (PyTorch's cudaMallocAsync
    backend: set_per_process_memory_fraction bounds the bytes torch hands out, not the driver pool's)."""
    r = t.result or {}
    if t.cap is None or not passed(r) or not r.get("max_reserved"):
        return
    over = r["max_reserved"] / runner.cap_bytes(t)
    row["reserved_over_cap"] = max(over, row.get("reserved_over_cap") or 0.0)


# ----------------------------------------------------------------------------- one workload


# A timed run's figures (the worker's keys) that its row keeps, as "uncapped_<key>" / "capped_<key>",
# per run (``*_runs``) and as their median over the runs.
TIMED_FIGURES = ("step_ms", "steady_step_ms", "steady_device_allocs", "steady_device_frees",
                 "steady_driver_ms", "steady_wait_ms")
# Kept as the first timed run's, every run's in ``*_runs`` (an OOM in any run at 1.05x fails the point).
TIMED_COUNTS = ("ooms", "steady_ooms")


def timed_figures(prefix: str, r: dict) -> dict:
    """A timed run's figures under the row's keys (prefix "uncapped" or "capped")."""
    return {f"{prefix}_{k}": r.get(k) for k in (*TIMED_FIGURES, *TIMED_COUNTS)}


def repeat_timed(workload: str, allocators: list, cap, rows: dict, runner: Runner, repeats: int) -> dict:
    """The timed run (uncapped: cap None, or at `cap`) `repeats - 1` more times per allocator, interleaved
    (a, b, c, a, b, c, ...) so that a drift of the machine touches every allocator alike; each row's step
    times (first pass and steady) become the medians of all its runs, and the runs are kept
    (``*_step_ms_runs``, ...) for the spread. Returns each allocator's extra results."""
    prefix = "uncapped" if cap is None else "capped"
    keys = [f"{prefix}_{k}" for k in (*TIMED_FIGURES, *TIMED_COUNTS)]
    runs = {a: {k: [rows[a].get(k)] for k in keys} for a in allocators}
    extra = {a: [] for a in allocators}
    for _ in range(repeats - 1):
        for a in allocators:
            r = runner.alone(Trial(workload, a, cap, False, runner.args.passes))
            extra[a].append(r)
            for k, v in timed_figures(prefix, r).items():
                runs[a][k].append(v)
    for a in allocators:
        for k in keys:
            rows[a][k + "_runs"] = runs[a][k]
        for k in TIMED_FIGURES:
            values = [v for v in runs[a][f"{prefix}_{k}"] if v is not None]
            if values:
                rows[a][f"{prefix}_{k}"] = statistics.median(values)
    return extra


def measure(workload: str, allocators: list, runner: Runner, args, deadline: float) -> dict:
    rows = {a: dict(workload=workload, allocator=a) for a in allocators}
    first = "native" if "native" in allocators else allocators[0]
    order = [first] + [a for a in allocators if a != first]
    for a in order:
        r = runner.alone(Trial(workload, a, None, False, args.passes))
        rows[a].update(timed_figures("uncapped", r), error=r.get("error"), max_allocated=r.get("max_allocated"),
                       max_reserved=r.get("max_reserved"), device=r.get("device"))
        if r.get("max_allocated") and r.get("max_reserved"):
            rows[a]["reserved_over_allocated"] = r["max_reserved"] / r["max_allocated"]
        if a == first and args.device == "cpu":
            break  # the workload's code once, tiny, no allocator: the other allocators would run the same
        if a == first:  # P: the first pass's peak (max_allocated), as a search trial runs one pass
            if r.get("error") or not r.get("max_allocated"):
                raise SystemExit(f"{workload}: the uncapped {a} run gave no peak: {r.get('error')}")
            runner.peak[workload] = r["max_allocated"]
            runner.total = runner.total or r["total_bytes"]
    ran = [a for a in order if "uncapped_step_ms" in rows[a] and not rows[a].get("error")]
    repeat_timed(workload, ran, None, rows, runner, args.repeats)
    if args.device == "cpu":
        return dict(rows=list(rows.values()))
    P = runner.peak[workload]
    searches = {a: Search(args.tolerance, runner.ceiling(workload))
                for a in allocators if not rows[a].get("error")}
    for a in searches:
        t = Trial(workload, a, TIMED_CAP, False, args.passes)
        r = runner.alone(t)
        rows[a].update(timed_figures("capped", r), capped_error=r.get("error"))
        note_reserved_over_cap(rows[a], t, runner)
        if r.get("error") is None:
            searches[a].record(TIMED_CAP, passed(r))
    # A capped run that failed with something other than an OOM: no cap can be trusted for that
    # allocator, so it is not searched (its row shows the error).
    for a in [a for a in searches if rows[a].get("capped_error")]:
        del searches[a]
    for a, extra in repeat_timed(workload, list(searches), TIMED_CAP, rows, runner, args.repeats).items():
        if any(not passed(r) for r in extra):  # an OOM in any of the timed runs fails the point
            searches[a].record(TIMED_CAP, False)
    rounds = search_rounds(workload, rows, searches, runner, args, deadline)
    return dict(peak_allocated=P, total_bytes=runner.total, rounds=rounds, rows=list(rows.values()))


def search_rounds(workload: str, rows: dict, searches: dict, runner: Runner, args, deadline: float) -> int:
    """Rounds of parallel trials until every search is done or the deadline has passed; each row gets
    its search's result. Returns the rounds run."""
    P = runner.peak[workload]
    ceiling = runner.ceiling(workload)
    rounds = 0
    while any(not s.done() for s in searches.values()) and time.monotonic() < deadline:
        active = [a for a, s in searches.items() if not s.done()]
        # The largest cap a trial of this round may take, for how many fit on the device at once.
        highest = max(searches[a].bracket()[1] or min(ceiling, 2 * (searches[a].bracket()[0] or 1))
                      for a in active)
        room = max(1, min(args.jobs, int(DEVICE_SHARE * runner.total // (highest * P + CONTEXT_BYTES))))
        trials = [Trial(workload, a, k, True)
                  for a in active for k in searches[a].propose(max(1, room // len(active)))]
        if not trials:
            break
        runner.parallel(trials)
        for t in trials:
            note_reserved_over_cap(rows[t.allocator], t, runner)
            if t.result.get("error") is None:
                searches[t.allocator].record(t.cap, passed(t.result))
            else:
                rows[t.allocator].setdefault("trial_errors", []).append(t.result["error"])
                searches[t.allocator].record(t.cap, False)
        rounds += 1
    for a, s in searches.items():
        rows[a].update(s.result())
    return rounds


def resume(workload: str, earlier: dict, runner: Runner, args, deadline: float) -> dict:
    """Goes on with the cap searches of an earlier run of `workload` (its result in --resume's JSON):
    its P, device, timed figures and trials are kept, each search starts from its bracket (at this
    run's --tolerance) and runs rounds until done or the deadline. Rows without a search (an error in
    the earlier run) stay as they were."""
    rows = {r["allocator"]: dict(r) for r in earlier["rows"]}
    runner.peak[workload] = earlier["peak_allocated"]
    runner.total = runner.total or earlier["total_bytes"]
    searches = {}
    for a, row in rows.items():
        if "trials" in row:
            searches[a] = Search(args.tolerance, runner.ceiling(workload))
            for cap, ok in row["trials"].items():
                searches[a].record(float(cap), bool(ok))
    rounds = search_rounds(workload, rows, searches, runner, args, deadline)
    return dict(earlier, rounds=earlier.get("rounds", 0) + rounds, resumed=earlier.get("resumed", 0) + 1,
                rows=list(rows.values()))


def load_earlier(path: str, args) -> dict:
    """--resume's JSON (a --json file of this bench), checked against this run's settings: trials of a
    run with other steps (--quick), on another device or under another --bound do not continue a search.
    Raises ValueError saying what is wrong."""
    try:
        with open(path) as f:
            doc = json.load(f)
        results, earlier_args = doc["results"], doc["args"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"--resume {path}: not a JSON file written by --json ({type(e).__name__}: {e})")
    # An earlier file without "bound" ran under the fraction (the only bound then).
    for key, unset in (("quick", None), ("device", None), ("bound", "fraction")):
        if earlier_args.get(key, unset) != getattr(args, key):
            raise ValueError(f"--resume {path}: its run had {key}={earlier_args.get(key, unset)!r}, this one "
                             f"{getattr(args, key)!r}: its trials ran other steps")
    for w, res in results.items():
        if not isinstance(res, dict) or not isinstance(res.get("rows"), list) or (
                "peak_allocated" not in res and args.device == "cuda"):
            raise ValueError(f"--resume {path}: workload {w!r} has no rows or peak: not this bench's JSON")
    return doc


# ----------------------------------------------------------------------------- the table


def fmt(x, spec=".3f"):
    return "-" if x is None else format(x, spec)


def cap_text(row):
    hi, lo = row.get("lowest_cap"), row.get("highest_failing")
    if hi is None:
        return f">{lo:.3f}" if lo is not None else "-"
    text = f"{hi:.4f}" if lo is not None else f"<={hi:.3f}"
    return text + ("" if row.get("converged") else "?")


def ratio(x, y):
    return x / y if x and y else None


def calls_per_step(row, prefix):
    """Device calls (allocs + frees) per step of a timed run's steady pass; None where not counted."""
    a, f = row.get(f"{prefix}_steady_device_allocs"), row.get(f"{prefix}_steady_device_frees")
    return None if a is None or f is None else a + f


def driver_text(row, prefix):
    """gpumem's host ms per steady step in driver calls / in waits for the device ('-' for others)."""
    d, w = row.get(f"{prefix}_steady_driver_ms"), row.get(f"{prefix}_steady_wait_ms")
    return "-" if d is None or w is None else f"{d:.2f}/{w:.2f}"


PAGE_BYTES = 2 << 20  # the driver's granularity for physical memory on the GPUs measured (H100, H200)


def page_count(nbytes, page=PAGE_BYTES):
    """Whole pages that hold `nbytes`."""
    return -(-nbytes // page)


def page_floor(peak_allocated, page=PAGE_BYTES):
    """The lowest cap (x P) that an allocator whose reserved memory is bounded by the cap and made of
    whole pages can reach: P rounded up to a page, every page filled. native, expandable_segments and
    gpumem reserve whole 2 MiB pages (segments rounded to them); a lowest cap below this floor bounds
    something else (cudaMallocAsync's fraction bounds the bytes torch hands out, not what the driver's
    pool reserves). P counts each tensor rounded to 512 B (native's rounding): the bytes asked for are
    at most 511 B a live tensor fewer, which moves the floor only where P lies that close above a
    page boundary. None without P."""
    if not peak_allocated:
        return None
    return page_count(peak_allocated, page) * page / peak_allocated


# (width, header): each wider than its header, so that headers of several words stay apart.
COLUMNS = ((9, "workload"), (10, "allocator"), (10, "0-OOM cap"), (8, "vs best"), (8, "ms free"), (8, "vs best"),
           (11, "ms free st"), (11, "vs best st"), (9, "ms @1.05"), (5, "ooms"), (7, "vs exp"), (12, "ms @1.05 st"),
           (8, "ooms st"), (10, "vs exp st"), (9, "calls st"), (12, "drv/wait st"), (14, "drv/wait @1.05"),
           (10, "res/alloc"), (8, "res/cap"))


def table(results: dict, bound: str = "fraction") -> str:
    """One line per (workload, allocator): first-pass and steady figures side by side ('-' for a
    figure the run does not have: one pass, an error, a search not run). `bound`: what the caps bound
    (--bound)."""
    def line(cells):
        return " ".join(f"{c:{'<' if i < 2 else '>'}{w}s}" for i, ((w, _), c) in enumerate(zip(COLUMNS, cells)))

    lines = [line([name for _, name in COLUMNS])]
    for w, res in results.items():
        rows = res["rows"]
        torch_rows = [r for r in rows if r["allocator"] in TORCH_ALLOCATORS]
        exp = next((r for r in rows if r["allocator"] == "expandable"), {})
        best_cap, best_ms, best_st = (min((r[k] for r in torch_rows if r.get(k)), default=None)
                                      for k in ("lowest_cap", "uncapped_step_ms", "uncapped_steady_step_ms"))
        for r in rows:
            ms, st = r.get("uncapped_step_ms"), r.get("uncapped_steady_step_ms")
            cms, cst = r.get("capped_step_ms"), r.get("capped_steady_step_ms")
            cells = [w, r["allocator"], cap_text(r), fmt(ratio(r.get("lowest_cap"), best_cap)),
                     fmt(ms, ".1f"), fmt(ratio(ms, best_ms)), fmt(st, ".1f"), fmt(ratio(st, best_st)),
                     fmt(cms, ".1f"), fmt(r.get("capped_ooms"), "d"), fmt(ratio(cms, exp.get("capped_step_ms"))),
                     fmt(cst, ".1f"), fmt(r.get("capped_steady_ooms"), "d"),
                     fmt(ratio(cst, exp.get("capped_steady_step_ms"))), fmt(calls_per_step(r, "capped"), ".1f"),
                     driver_text(r, "uncapped"), driver_text(r, "capped"),
                     fmt(r.get("reserved_over_allocated")), fmt(r.get("reserved_over_cap"), ".4f")]
            lines.append(line(cells) + (f"  error: {r['error']}" if r.get("error") else "")
                         + (f"  capped error: {r['capped_error']}" if r.get("capped_error") else ""))
    for w, res in results.items():
        floor = page_floor(res.get("peak_allocated"))
        if floor is not None:
            lines.append(f"{w}: P {res['peak_allocated'] / (1 << 20):,.1f} MiB; page floor {floor:.4f}x "
                         f"({page_count(res['peak_allocated']):,} pages of 2 MiB, every page full)")
    lines.append("0-OOM cap: lowest cap (x native's uncapped peak allocated) with 0 OOM steps ('?': search "
                 "unfinished, '>x': none up to x); vs best: / the best PyTorch allocator's; ms free: step time "
                 "uncapped, first pass over the steps (each shape new: its one-time costs, no allocator's); "
                 "st: steady, the later passes (the same shapes again: the allocator's cost once shapes "
                 "repeat); ms @1.05: at a 1.05x cap (ooms: its OOM steps, per pass), vs exp: / "
                 "expandable_segments'; calls st: device allocs + frees per step of the steady pass at "
                 "1.05x; drv/wait: gpumem's host ms per steady step in driver calls / waiting for the device, "
                 "uncapped and at 1.05x; res/cap: the highest max reserved / cap of its passing capped runs "
                 "(above 1: it held more of the device than the cap); page floor: P rounded up to whole "
                 "2 MiB pages, / P: no allocator whose reserved memory the cap bounds goes below it.")
    if bound == "device":
        lines.append("Caps bound the device's memory (--bound device): a ballast outside the allocator left "
                     "it the cap, after one unmeasured pass over the steps.")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- the command line


def rmm_importable() -> bool:
    r = subprocess.run([sys.executable, "-c", "import rmm.allocators.torch"], capture_output=True)
    return r.returncode == 0


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", default=",".join(WORKLOADS),
                    help=f"comma-separated, from {','.join(WORKLOADS)} (default: all)")
    ap.add_argument("--allocators", default=None,
                    help=f"comma-separated, from {','.join(ALLOCATORS)} (default: all; rmm where it imports). "
                         "gpumem: GPUMEM_CONF=release:lazy,stitch:true (the defaults); gpumem_nostitch: "
                         "release:lazy,stitch:false; gpumem_hw: release:high_water,stitch:false; any of "
                         "the three with GPUMEM_CONF keys added after '+' (gpumem+ends_by_page:true)")
    ap.add_argument("--quick", action="store_true", help="half the steps, a 1%% tolerance")
    ap.add_argument("--tolerance", type=float, default=None, help="search resolution in units of P (0.0025)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="timed runs (uncapped, and at 1.05x) per allocator, interleaved; the median is "
                         "shown, every run kept in the JSON (default 1; step-time differences of a few %% "
                         "need 3 or more: two runs of one allocator can differ by 10%%; for 1%%, "
                         "bench/lockstep.py)")
    ap.add_argument("--passes", type=int, default=2,
                    help="passes over the step list of each timed run (default 2): the first's step time, "
                         "and the later ones' (steady: the same shapes again); 1: the first pass alone. "
                         "A search trial runs one pass")
    ap.add_argument("--jobs", type=int, default=8, help="trials at once on the GPU, at most")
    ap.add_argument("--budget-s", type=float, default=420, help="no new search round after this many seconds")
    ap.add_argument("--json", help="write every figure and trial to this file")
    ap.add_argument("--resume", metavar="JSON",
                    help="go on with the cap searches of an earlier run (its --json file): its workloads' "
                         "timed figures and trials are kept, each unfinished search continues from its "
                         "bracket; workloads it lacks are measured from the start. The new --json holds "
                         "the earlier run's other workloads too, so calls can be chained")
    ap.add_argument("--release-slack", type=release_slack_arg, default=None, metavar="S",
                    help="gpumem_hw's release_slack: how far reserved may exceed the live high water "
                         "(default gpumem's, 0.005)")
    ap.add_argument("--bound", default="fraction", choices=("fraction", "device"),
                    help="what a cap bounds: fraction (default): torch.cuda.set_per_process_memory_fraction; "
                         "device: the device's memory itself, a ballast outside every allocator leaving the "
                         "allocator the cap (bench/pressure_workloads.py; one trial at a time; no rmm)")
    ap.add_argument("--dry-run", action="store_true", help="print the plan, run nothing")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                    help="cpu: each workload's code once, tiny, no allocator or cap (CI)")
    args = ap.parse_args(argv)
    args.workloads = [w for w in args.workloads.split(",") if w]
    bad = [w for w in args.workloads if w not in WORKLOADS]
    if bad or not args.workloads:
        ap.error(f"unknown workload(s) {bad}; choose from {','.join(WORKLOADS)}")
    if args.allocators is None:
        args.allocators = [a for a in ALLOCATORS if a != "rmm"]
        args.rmm_auto = True
    else:
        args.allocators = [a for a in args.allocators.split(",") if a]
        args.rmm_auto = False
        bad = [a for a in args.allocators if not is_allocator(a)]
        if bad or not args.allocators:
            ap.error(f"unknown allocator(s) {bad}; choose from {','.join(ALLOCATORS)}")
    if args.tolerance is None:
        args.tolerance = 0.01 if args.quick else 0.0025
    if not 0 < args.tolerance < 1:
        ap.error("--tolerance must be in (0, 1)")
    if args.jobs < 1:
        ap.error("--jobs must be at least 1")
    if args.repeats < 1:
        ap.error("--repeats must be at least 1")
    if args.passes < 1:
        ap.error("--passes must be at least 1")
    if args.bound == "device" and not args.rmm_auto and "rmm" in args.allocators:
        ap.error("--bound device: rmm is bounded by its pool's maximum size only; "
                 "leave it out of --allocators")
    if args.bound == "device":
        args.rmm_auto = False  # not added where it imports: see above
        args.jobs = 1  # each trial's ballast takes the whole device: one trial at a time
    if args.release_slack is not None and "gpumem_hw" not in args.allocators:
        ap.error("--release-slack applies to gpumem_hw, which --allocators does not name")
    args.earlier = None
    if args.resume:
        try:
            args.earlier = load_earlier(args.resume, args)
        except ValueError as e:
            ap.error(str(e))
    return args


def plan(args) -> str:
    slack = f" (gpumem_hw: release_slack {args.release_slack:g})" if args.release_slack is not None else ""
    lines = [f"device {args.device}; workloads {', '.join(args.workloads)}; allocators "
             f"{', '.join(args.allocators)}{' (+rmm if it imports)' if args.rmm_auto else ''}{slack}"]
    passes = (f", {args.passes} passes over the steps" if args.passes > 1 else ", 1 pass") + " each"
    first = "native" if "native" in args.allocators else args.allocators[0]  # as measure() orders them
    earlier = args.earlier["results"] if args.earlier else {}
    for w in args.workloads:
        if w in earlier and args.device == "cuda":
            left = [r["allocator"] for r in earlier[w]["rows"] if "trials" in r and not r.get("converged")]
            lines.append(f"{w}: resumed from {args.resume} (P and timed runs kept); searches left: "
                         f"{', '.join(left) or 'none'}, to {args.tolerance:g} P, up to {args.jobs} trials at once")
            continue
        if args.device == "cpu":  # no allocator on the CPU: the first one's runs alone (see measure)
            lines.append(f"{w}: uncapped alone x{args.repeats}{passes} ({first} only: no allocator on the CPU)")
            continue
        runs = len(args.allocators) * args.repeats
        lines.append(f"{w}: uncapped alone x{runs}{passes} ({first} first: P); {TIMED_CAP}x P alone x{runs}"
                     f"{passes}; bisection of the 0-OOM cap in [{FLOOR}, 0.9 total / P] to {args.tolerance:g} P, "
                     f"up to {args.jobs} trials at once, 1 pass each")
    if args.bound == "device":
        lines.append("caps bound the device's memory (a ballast outside the allocator, after one unmeasured "
                     "pass; one trial at a time), not set_per_process_memory_fraction")
    lines.append(f"no new round after {args.budget_s:g} s" + ("; --quick: half the steps" if args.quick else ""))
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.rmm_auto and args.device == "cuda" and not args.dry_run and rmm_importable():
        args.allocators.append("rmm")
    print(plan(args), flush=True)
    if args.dry_run:
        return 0
    start = time.monotonic()
    runner = Runner(args)
    earlier = args.earlier["results"] if args.earlier else {}
    results = {}
    if args.earlier:  # the earlier run's trials and other workloads stay in this run's JSON
        runner.log = list(args.earlier.get("trials", []))
        results = {w: res for w, res in earlier.items() if w not in args.workloads}
    for w in args.workloads:
        t0 = time.monotonic()
        if w in earlier and args.device == "cuda":
            results[w] = resume(w, earlier[w], runner, args, start + args.budget_s)
        else:
            results[w] = measure(w, args.allocators, runner, args, start + args.budget_s)
        print(f"{w}: {time.monotonic() - t0:.0f} s", flush=True)
        # Each workload's figures are out (table and JSON) before the next starts, so a call that the
        # device's time limit cuts short still keeps what it measured.
        print(table({w: results[w]}, args.bound), flush=True)
        kept = {k: v for k, v in vars(args).items() if k != "earlier"}
        doc = dict(args=kept, results=results, trials=runner.log, seconds=time.monotonic() - start)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(doc, f, indent=1)
    if len(results) > 1:
        print(table(results, args.bound), flush=True)
    print(json.dumps(dict((w, {r["allocator"]: r.get("lowest_cap") for r in res["rows"]})
                          for w, res in results.items())), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
