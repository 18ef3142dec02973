"""Step times of allocators compared in lockstep: one process per allocator, alive together, taking turns.

    python bench/lockstep.py [--workloads bert,ckpt] [--allocators native,expandable,async,gpumem]
                             [--rounds 12] [--cap 1.05] [--budget-s 150] [--json OUT.json] [--device cpu]
                             [--first-pass turns|together] [--reference ALLOCATOR]
    python bench/lockstep.py --from-json RUN.json [RUN2.json ...] [--reference ALLOCATOR]

Why. The step time of one allocator differs from run to run by more than the 1% that the project's
targets ask about. On the GPU machine (one H100, 2026-11-27) allocfree's steady step with PyTorch's
native allocator was 5.0 to 10.3 ms over twelve runs, pinned to CPUs or not; the passes of one run
agreed within 8% in eight of the twelve runs while runs a minute apart differed up to
twofold, as if the host's speed drifted over seconds: two allocators run one after the other meet
different hosts, and bench/pressure.py's timed runs (one process per run, in turn) need many repeats
to see 1%.

Here the workers (bench/pressure_workloads.py --lockstep, one per allocator) start together and each
keeps its process, CUDA context and cache to the end; then they take turns, one pass over the
workload's steps each, in an order that rotates every round, so that one round's passes lie within a
few seconds of each other. Round 0 is each worker's first pass (shapes new to the process: one-time
costs that are no allocator's) and is not compared; rounds 1..R are. A worker waiting for its turn
blocks on a pipe: it takes no CPU and launches nothing on the GPU. --first-pass together runs round 0's
passes at once (generate's first pass is ~50 s a worker, its later ones ~3 s).

Per round, each allocator's step time over the reference's of the same round; the reference is the
PyTorch allocator (native, expandable, async; those run) with the lowest median step over the
rounds, uncapped, and expandable_segments' at a cap (the targets' "<= expandable_segments' at 1.05x";
the fastest PyTorch allocator run where expandable is not). Printed per allocator: the median step
(ms), the median per-round ratio with its quartiles, and for gpumem the device calls and driver ms per
step; `target` says whether the median ratio is at most 1.01 uncapped, 1.00 at a cap (the quartiles say how
sure that is). Rounds where any worker had an OOM
step are left out of the ratios (counted in `oom rounds`). Under each table, per gpumem configuration, a
least-squares line through its rounds: its step minus the reference's against its driver + wait ms a
step (driver_fit): the difference left at no driver time, how much of a driver millisecond the step
pays, and the correlation, which says whether the driver's time is what the difference follows.

A gpumem name ending in @DIR runs the gpumem build installed in DIR (pip install --target DIR), so that
two builds of the pool take turns in one run (gpumem,gpumem@/tmp/before). Two workers running the same
code still differ: on allocfree, whose steps are host-bound, by 5.7% uncapped over 20 rounds (two builds
whose difference acts only under a cap; one H100, 2026-12-06; docs/benchmarks.md, "Release order"), so a ratio
nearer 1 than that says nothing there; the same build twice (DIR where it is installed) measures it.

--cap K also runs every allocator capped at K P (set_per_process_memory_fraction(K P / total)), P being
native's peak allocated bytes over its first pass in the uncapped group, which therefore runs first
and must include native. Uncapped, the workers' caches share the device's memory: a worker whose pass
meets the device's end shows OOM rounds, and the figures of such a run say so. --budget-s stops a
group from starting another round once its compared rounds have taken that many seconds (round 0 not
counted; at least one compared round is run); --rounds caps it. --device cpu runs each workload tiny
on the CPU with no allocator (every worker the same code; the path CI covers).

Writes every round's figures and each worker's final JSON line (its peaks) with --json, the whole file
again after every round: a run cut short leaves the rounds it finished (its group marked "cut"). --from-json
prints the tables of such files again, several runs' rounds of a workload pooled (docs/benchmarks.md's figures
over several calls: bench/results/).
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pressure import TORCH_ALLOCATORS, WORKER, fmt, worker_env  # (imports no torch)
from pressure_workloads import ALLOCATORS, WORKLOADS, is_allocator

TURN_TIMEOUT_S = 600  # one pass of one worker: far past any workload's; a worker stuck longer is ended
# The issue's targets, as a bound on the median per-round ratio: uncapped "<= the fastest PyTorch
# allocator's + 1%", at a cap "<= expandable_segments'".
TARGET_UNCAPPED, TARGET_CAPPED = 1.01, 1.00


class Worker:
    """One allocator's process of a group: started with --lockstep, given a turn with turn(), its
    stdout read by a thread (a queue of lines) so that a worker that dies or hangs ends its turn."""

    def __init__(self, workload: str, allocator: str, passes: int, fraction: float | None, device: str):
        cmd = [sys.executable, WORKER, workload, allocator if device == "cuda" else "none",
               "--device", device, "--passes", str(passes), "--lockstep"]
        if device == "cpu":
            cmd.append("--tiny")
        if fraction is not None:
            cmd += ["--fraction", f"{fraction:.8f}"]
        self.allocator = allocator
        self.stderr = tempfile.TemporaryFile(mode="w+")  # a file, not a pipe: a chatty worker cannot block
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr,
                                     text=True, env=worker_env())
        self.lines: queue.Queue = queue.Queue()
        self.error: str | None = None
        self.final: dict = {}
        self.sent = 0.0  # when go() last gave the worker a turn
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)  # end of output: the worker exited

    def _fail(self, why: str) -> None:
        self.stderr.seek(0)
        tail = " | ".join(self.stderr.read().strip().splitlines()[-3:])
        self.error = f"{why}{': ' + tail if tail else ''}"
        self.proc.kill()

    def turn(self) -> dict | None:
        """Runs one pass: its figures (the worker's PASS line), or None where the worker failed (error)."""
        self.go()
        return self.wait()

    def go(self) -> None:
        """Starts the worker's next pass without waiting for it (wait() collects it)."""
        if self.error:
            return
        self.sent = time.monotonic()
        try:
            self.proc.stdin.write("go\n")
            self.proc.stdin.flush()
        except OSError:
            self._fail(f"exited (code {self.proc.poll()})")

    def wait(self) -> dict | None:
        """The pass that go() started: its figures, or None where the worker failed (error)."""
        if self.error:
            return None
        while True:
            try:
                line = self.lines.get(timeout=TURN_TIMEOUT_S)
            except queue.Empty:
                self._fail(f"no pass finished in {TURN_TIMEOUT_S} s")
                return None
            if line is None:
                self._fail(f"exited (code {self.proc.wait()})")
                return None
            if line.startswith("PASS "):
                # When the driver gave the turn and read its end (monotonic seconds): the order of turns.
                return dict(json.loads(line[5:]), sent=self.sent, collected=time.monotonic())
            if line.startswith("{"):
                self.final = json.loads(line)

    def finish(self) -> dict:
        """Ends the worker (end of its stdin: it stops before its next pass) and returns its final JSON."""
        if not self.error:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
            try:
                while (line := self.lines.get(timeout=TURN_TIMEOUT_S)) is not None:
                    if line.startswith("{"):
                        self.final = json.loads(line)
            except queue.Empty:
                self._fail(f"did not exit {TURN_TIMEOUT_S} s after its last turn")
            if not self.error and self.proc.wait() != 0:
                self._fail(f"exited (code {self.proc.returncode})")
        self.stderr.close()
        return self.final


def run_group(workload: str, allocators: list, fraction_of: dict, args, log, after_round=None) -> dict:
    """One group: every allocator's worker alive together, round 0 then up to --rounds compared rounds
    in rotating order. `fraction_of[a]`: its set_per_process_memory_fraction (None: uncapped).
    Returns {allocator: {"rounds": [PASS figures or None per round], "error", "final"}}; `after_round`,
    if given, gets the group so far after each round (no final figures yet)."""
    workers = [Worker(workload, a, args.rounds + 1, fraction_of.get(a), args.device) for a in allocators]
    rounds: dict = {w.allocator: [] for w in workers}
    t0 = 0.0  # set as round 1 starts: the budget is the compared rounds'
    r = 0
    while r <= args.rounds:
        if r == 1:
            t0 = time.monotonic()
        if r >= 2 and time.monotonic() - t0 > args.budget_s:
            log(f"  budget of {args.budget_s:.0f} s spent after {r - 1} compared rounds")
            break
        k = r % len(workers)
        if r == 0 and args.first_pass == "together":
            for w in workers:  # every first pass at once: not compared, so only its length matters
                w.go()
            for w in workers:
                rounds[w.allocator].append(w.wait())
        else:
            for w in workers[k:] + workers[:k]:  # round 0: in the given order (native first)
                rounds[w.allocator].append(w.turn())
        done = "  ".join(f"{a} {fmt((p or {}).get('step_ms'), '.1f')}" for a, p in
                         ((a, rounds[a][-1]) for a in allocators))
        log(f"  round {r}{' (first pass, not compared)' if r == 0 else ''}: {done}")
        if after_round is not None:
            after_round({a: dict(rounds=list(rounds[a]), final={}, error=None) for a in allocators})
        r += 1
    return {w.allocator: dict(rounds=rounds[w.allocator], final=w.finish(), error=w.error) for w in workers}


def merge_groups(groups: list) -> dict:
    """One group of several runs' groups of a workload (JSON files of separate calls): the allocators
    all of them ran, in the first's order, each with the first run's rounds and every later run's
    compared rounds (its round 0 left out, so that the merged round 0 is the first run's alone); the
    first error of each, the first run's final figures."""
    names = [a for a in groups[0] if all(a in g for g in groups[1:])]
    return {a: dict(rounds=groups[0][a]["rounds"] + [p for g in groups[1:] for p in g[a]["rounds"][1:]],
                    error=next((g[a]["error"] for g in groups if g[a]["error"]), None),
                    final=groups[0][a]["final"]) for a in names}


def driver_fit(group: dict, a: str, reference: str, rounds: list) -> dict | None:
    """How allocator `a`'s step over the reference's follows its host time in the driver: a least-squares
    line through the rounds' (driver ms + wait ms a step, step ms - the reference's step ms), with its
    correlation. The intercept is the difference left at no driver time, the slope how much of a
    driver millisecond the step pays (0: hidden under the GPU's work, 1: all of it). None for an
    allocator with no driver figures (PyTorch's) or fewer than three rounds that differ."""
    xs, ys = [], []
    for r in rounds:
        p, ref = group[a]["rounds"][r], group[reference]["rounds"][r]
        if p.get("driver_ms") is None:
            return None
        xs.append(p["driver_ms"] + (p.get("wait_ms") or 0.0))
        ys.append(p["step_ms"] - ref["step_ms"])
    if len(xs) < 3:
        return None
    try:
        line = statistics.linear_regression(xs, ys)
        r = statistics.correlation(xs, ys)
    except statistics.StatisticsError:  # every round the same driver time (or the same difference)
        return None
    return dict(intercept_ms=line.intercept, slope=line.slope, r=r, rounds=len(xs))


def summarize(group: dict, capped: bool, reference: str | None = None) -> dict:
    """The group's comparison. Per allocator: its compared rounds (those after round 0 in which every
    worker finished its pass), its median step and median OOM steps per pass over them, and its per-round
    ratio to the reference (median, quartiles) over the rounds in which neither had an OOM step (a pass
    with OOM steps skips their work: its time says nothing of the allocator's speed); gpumem's device
    calls and driver ms per step. The reference: expandable_segments' at a cap where it ran rounds
    without an OOM step, otherwise the PyTorch allocator with the lowest median over such rounds;
    `reference` names another (a worker of the group)."""
    names = list(group)
    n = min(len(v["rounds"]) for v in group.values())
    finished = (lambda p: p is not None and p.get("step_ms") is not None)
    compared = [r for r in range(1, n) if all(finished(group[a]["rounds"][r]) for a in names)]
    passes = {a: [group[a]["rounds"][r] for r in compared] for a in names}
    clean = {a: [r for r, p in zip(compared, passes[a]) if not p["ooms"]] for a in names}

    def ms_of(a: str, rounds: list) -> list:
        return [group[a]["rounds"][r]["step_ms"] for r in rounds]

    clean_median = {a: statistics.median(ms_of(a, clean[a])) for a in names if clean[a]}
    torch_ones = [a for a in names if a in TORCH_ALLOCATORS and a in clean_median]
    if reference is not None:
        if reference not in group:
            raise ValueError(f"reference {reference!r} is not among the group's allocators {names}")
    elif capped and "expandable" in torch_ones:
        reference = "expandable"
    else:
        reference = min(torch_ones, key=lambda a: clean_median[a]) if torch_ones else None
    rows = {}
    for a in names:
        ms = [p["step_ms"] for p in passes[a]]
        row = dict(median_ms=statistics.median(ms) if ms else None, rounds_ms=ms,
                   ooms_per_pass=statistics.median(p["ooms"] for p in passes[a]) if ms else None,
                   error=group[a]["error"])
        both = [r for r in clean[a] if reference is not None and r in clean[reference]]
        if both:
            ratios = [x / y for x, y in zip(ms_of(a, both), ms_of(reference, both))]
            q = statistics.quantiles(ratios, n=4, method="inclusive") if len(ratios) > 1 else ratios * 3
            row.update(ratio=statistics.median(ratios), ratio_q1=q[0], ratio_q3=q[2], ratios=ratios,
                       ratio_rounds=len(both))
            row["driver_fit"] = driver_fit(group, a, reference, both)
        calls = [p.get("device_calls") for p in passes[a]]
        driver = [p.get("driver_ms") for p in passes[a]]
        row["device_calls"] = statistics.median(calls) if calls and None not in calls else None
        row["driver_ms"] = statistics.median(driver) if driver and None not in driver else None
        final = group[a]["final"]
        if final.get("max_allocated"):
            row["reserved_over_allocated"] = (final.get("steady_max_reserved", final.get("max_reserved", 0))
                                              / final.get("steady_max_allocated", final["max_allocated"]))
        rows[a] = row
    return dict(reference=reference, capped=capped, compared_rounds=len(compared), allocators=rows)


def table(workload: str, label: str, s: dict) -> str:
    target = TARGET_CAPPED if s["capped"] else TARGET_UNCAPPED
    head = (f"{workload} {label}: {s['compared_rounds']} rounds compared; reference {s['reference'] or '-'}; "
            f"target: median ratio <= {target:.2f}")
    width = max([16] + [len(a) + 1 for a in s["allocators"]])  # gpumem+KEY:VALUE names are long
    lines = [head, f"{'allocator':<{width}}{'median ms':>10}{'OOM/pass':>9}{'ratio':>8}{'q1':>8}{'q3':>8}{'of':>4}"
                   f"  {'target':<8}{'calls/step':>11}{'drv ms/step':>12}{'res/alloc':>10}  error"]
    for a, row in s["allocators"].items():
        ratio = row.get("ratio")
        within = "-" if ratio is None or a == s["reference"] else ("met" if ratio <= target else "not met")
        lines.append(f"{a:<{width}}{fmt(row['median_ms'], '.2f'):>10}{fmt(row['ooms_per_pass'], 'g'):>9}"
                     f"{fmt(ratio, '.4f'):>8}"
                     f"{fmt(row.get('ratio_q1'), '.4f'):>8}{fmt(row.get('ratio_q3'), '.4f'):>8}"
                     f"{fmt(row.get('ratio_rounds'), 'd'):>4}  {within:<8}"
                     f"{fmt(row['device_calls'], '.1f'):>11}{fmt(row['driver_ms'], '.3f'):>12}"
                     f"{fmt(row.get('reserved_over_allocated'), '.3f'):>10}  {row['error'] or ''}")
    for a, row in s["allocators"].items():
        fit = row.get("driver_fit")
        if fit and a != s["reference"]:
            lines.append(f"  {a}: step - {s['reference']}'s = {fit['intercept_ms']:+.2f} ms + {fit['slope']:.2f} x "
                         f"(driver + wait ms a step), r {fit['r']:.2f}, {fit['rounds']} rounds")
    return "\n".join(lines)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", default="bert",
                    help=f"comma-separated, from {','.join(WORKLOADS)} (default bert)")
    ap.add_argument("--allocators", default="native,expandable,async,gpumem",
                    help=f"comma-separated, from {','.join(a for a in ALLOCATORS if a != 'rmm')} "
                         "(default native,expandable,async,gpumem); names repeat at most once; a gpumem "
                         "name with GPUMEM_CONF keys added after '+' is a configuration of its own "
                         "(gpumem+stitch_slack:0.015), and one ending in @DIR runs the gpumem build "
                         "installed in DIR (pip install --target DIR: gpumem,gpumem@/tmp/before A/Bs two "
                         "builds of the pool)")
    ap.add_argument("--rounds", type=int, default=12, help="compared rounds per group, at most (default 12)")
    ap.add_argument("--cap", type=float, default=None,
                    help="also a capped group at this multiple of native's uncapped peak allocated "
                         "(e.g. 1.05)")
    ap.add_argument("--budget-s", type=float, default=150,
                    help="no new round of a group once its compared rounds took this many seconds "
                         "(default 150)")
    ap.add_argument("--first-pass", default="turns", choices=("turns", "together"),
                    help="round 0 (not compared) in turns like the others (default), or every worker's "
                         "at once: shorter where a first pass is long (generate: ~50 s a worker), but the "
                         "uncapped workers' caches then share the device's memory at once")
    ap.add_argument("--json", help="write every round's figures here")
    ap.add_argument("--from-json", nargs="+", metavar="FILE",
                    help="run nothing: the tables of earlier runs' --json files, the rounds of the files "
                         "merged per workload and group (the allocators all of them ran; --workloads "
                         "and --allocators are then ignored)")
    ap.add_argument("--reference", help="compare with this allocator instead of the one chosen by the rule "
                                        "above (any worker of the group)")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                    help="cpu: each workload tiny, no allocator (the code path)")
    args = ap.parse_args(argv)
    args.workloads = [w for w in args.workloads.split(",") if w]
    args.allocators = [a for a in args.allocators.split(",") if a]
    bad = [w for w in args.workloads if w not in WORKLOADS]
    if bad or not args.workloads:
        ap.error(f"unknown workload(s) {bad}; choose from {','.join(WORKLOADS)}")
    bad = [a for a in args.allocators if not is_allocator(a) or a == "rmm"]
    if bad or len(args.allocators) < 2 or len(set(args.allocators)) != len(args.allocators):
        ap.error(f"--allocators needs two or more distinct names from {','.join(ALLOCATORS[:-1])}; got "
                 f"{','.join(args.allocators)}")
    if not any(a in TORCH_ALLOCATORS for a in args.allocators):
        ap.error("--allocators needs a PyTorch allocator (native, expandable or async) as the reference")
    if args.reference is not None and not args.from_json and args.reference not in args.allocators:
        ap.error(f"--reference {args.reference} is not among --allocators")
    if args.cap is not None and ("native" not in args.allocators or not 0.5 <= args.cap <= 4):
        ap.error("--cap K needs native among --allocators (P is its peak) and 0.5 <= K <= 4")
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    if args.budget_s <= 0:
        ap.error("--budget-s must be positive")
    return args


def from_json(paths: list, reference: str | None) -> int:
    """--from-json: the saved runs' groups merged and summarized again (nothing runs)."""
    runs = []
    for path in paths:
        try:
            with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
                runs.append(json.load(f))
        except (OSError, ValueError, EOFError) as e:  # missing, not JSON, not gzip, truncated
            print(f"lockstep: {path}: {e}", file=sys.stderr)
            return 2
    if not all(isinstance(run, dict) for run in runs):
        print("lockstep: --from-json: not a lockstep --json file (its top level is not an object)", file=sys.stderr)
        return 2
    printed = 0
    for w in [w for w in runs[0] if all(w in run for run in runs[1:])]:
        try:
            labels = [g for g in runs[0][w] if all(g in run[w] for run in runs[1:])]
            for label in labels:
                group = merge_groups([run[w][label]["group"] for run in runs])
                if not group:
                    raise KeyError(f"{label}: no allocator common to every file's group")
                s = summarize(group, capped=runs[0][w][label].get("cap") is not None, reference=reference)
                name = f"{label} ({len(runs)} runs merged)" if len(runs) > 1 else label
                cut = sum(bool(run[w][label].get("cut")) for run in runs)
                if cut:  # a run ended during this group: the rounds it finished, no final figures
                    name += f" (cut short in {cut} of {len(runs)} runs)" if len(runs) > 1 else " (cut short)"
                print(table(w, name, s), flush=True)
                printed += 1
        except (KeyError, TypeError, AttributeError, statistics.StatisticsError) as e:
            print(f"lockstep: {w}: not a lockstep --json group ({e!r})", file=sys.stderr)
            return 2
        except ValueError as e:  # a --reference the group lacks
            print(f"lockstep: {w}: {e}", file=sys.stderr)
            return 2
    if not printed:
        print("lockstep: --from-json: no workload and group common to every file", file=sys.stderr)
        return 2
    return 0


def save_json(path: str | None, out: dict) -> None:
    """--json: the figures so far, written whole after every round (a file beside it, then renamed), so
    that a run cut short (a GPU call's time limit) leaves every round it finished. A group still running
    says "cut": true and has no final figures (no reserved / allocated column). A path ending in .gz is
    written gzipped, as --from-json reads it."""
    if not path:
        return
    tmp = f"{path}.part"
    with (gzip.open(tmp, "wt") if path.endswith(".gz") else open(tmp, "w")) as f:
        json.dump(out, f, indent=1)
    os.replace(tmp, path)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.from_json:
        return from_json(args.from_json, args.reference)
    log = lambda text: print(text, file=sys.stderr, flush=True)  # progress, on stderr apart from the tables
    # native first: its first pass gives P, and round 0 runs in this order.
    allocators = sorted(args.allocators, key=lambda a: a != "native")
    out: dict = {}
    tables = []
    for w in args.workloads:
        out[w] = {}
        groups = [("uncapped", None)] + ([(f"at {args.cap}x", args.cap)] if args.cap is not None else [])
        for label, cap in groups:
            fractions: dict = {}
            if cap is not None:
                first = out[w]["uncapped"]["group"]["native"]["rounds"][0] or {}
                if not first.get("max_allocated") or not first.get("total_bytes"):
                    log(f"{w} {label}: skipped, native's uncapped first pass gave no peak")
                    continue
                share = cap * first["max_allocated"] / first["total_bytes"]
                fractions = {a: min(1.0, share) for a in allocators}
            log(f"{w} {label}: {', '.join(allocators)}, up to {args.rounds} rounds")

            def keep(group, w=w, label=label, cap=cap, fractions=fractions, cut=True):
                s = summarize(group, capped=cap is not None, reference=args.reference)
                out[w][label] = dict(group=group, summary=s, cap=cap, fractions=fractions, cut=cut)
                save_json(args.json, out)
                return s

            group = run_group(w, allocators, fractions, args, log, after_round=keep if args.json else None)
            s = keep(group, cut=False)
            tables.append(table(w, label, s))
            print(tables[-1], flush=True)
    failed = [(w, a) for w in out for g in out[w].values() for a, v in g["group"].items() if v["error"]]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
