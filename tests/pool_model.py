"""What a correct pool must agree with, shared by the pool tests (tests/test_pool*.py): live blocks,
their sizes, nothing overlapping, nothing leaking, reserved never past the cap; and how they run
operations on several threads at once; allocfree's requests as a trace."""
import sys
import threading
from pathlib import Path

MiB = 1 << 20
GiB = 1 << 30
ROOT = Path(__file__).resolve().parents[1]


def flat(stats, key, which="current"):
    return stats[key]["all"][which]


def hole_then_larger(pool):
    """64 MiB freed between live blocks (an 8 MiB one after it), then a 96 MiB block that does not fit
    in the hole: what the stitching, high-water and bound tests build. Returns (a, sep, c): the freed
    block's address, the 8 MiB block and the 96 MiB one."""
    a = pool.allocate(64 * MiB)
    sep = pool.allocate(8 * MiB)
    pool.free(a)
    c = pool.allocate(96 * MiB)
    pool.validate()
    return a, sep, c


class Model:
    """What a correct pool must agree with: live blocks, their sizes, nothing overlapping."""

    def __init__(self, pool, device):
        self.pool, self.device = pool, device
        self.live = {}  # address -> (requested, stream)
        self.reserved = 0  # reserved bytes at the previous check

    def check(self):
        self.pool.validate()
        s = self.pool.stats()
        assert flat(s, "allocation") == len(self.live)
        assert flat(s, "requested_bytes") == sum(r for r, _ in self.live.values())
        rounded = sum(-(-r // 512) * 512 for r, _ in self.live.values())
        assert flat(s, "allocated_bytes") == rounded
        # Every byte the device handed out is accounted as reserved: nothing leaks.
        assert self.device.used_bytes == flat(s, "reserved_bytes")
        # No operation takes reserved past the cap (or the limit: effective_cap is the lower one).
        # Reserved stays above it only where set_cap() / set_limit() lowered it below pages that live
        # blocks pin: then nothing makes it grow.
        bound = self.pool.effective_cap
        reserved = flat(s, "reserved_bytes")
        assert reserved <= max(bound, self.reserved), (reserved, bound, self.reserved)
        self.reserved = reserved
        spans = sorted((a, -(-r // 512) * 512) for a, (r, _) in self.live.items())
        for (a, n), (b, _) in zip(spans, spans[1:]):
            assert a + n <= b, "live blocks overlap"
        for a, _ in spans:
            assert a % 512 == 0
        # No physical page is visible to live blocks at two addresses: a unit the pool mapped a second
        # time elsewhere (lent, stitched, parked) never backs two live blocks at once.
        seen = {}
        for a, n in spans:
            for page in range(a // (2 * MiB) * (2 * MiB), a + n, 2 * MiB):
                unit = self.device.physical_unit_at(page)
                if unit[0]:
                    assert seen.setdefault(unit, page) == page, "one physical page under live blocks at two addresses"


def run_threads(work, n=4, timeout=120, hang="a thread did not finish"):
    """work(i) for i in range(n), each on its own thread, all at once. Fails with the exceptions the
    threads raised, or with `hang` when one is still running after `timeout` seconds (a deadlock)."""
    errors = []

    def guarded(i):
        try:
            work(i)
        except Exception as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=guarded, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout)
    assert not any(t.is_alive() for t in threads), hang
    assert not errors, errors


def random_size(rng):
    kind = rng.random()
    if kind < 0.5:
        return rng.randint(1, 1 * MiB)  # small pool
    if kind < 0.9:
        return rng.randint(1 * MiB + 1, 64 * MiB)
    return rng.randint(64 * MiB, 600 * MiB)


def allocfree_trace(tmp_path, seed):
    """allocfree's requests on `seed` (bench/pressure_workloads.py: 256 B to 64 MiB, at most 32 alive),
    written as a trace file under tmp_path by bench/record_trace.py; returns its path."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import record_trace
    finally:
        sys.path.pop(0)
    lines, allocations, peak = record_trace.allocfree_trace(seed)
    path = tmp_path / f"allocfree{seed}.trace"
    header = f"# workload allocfree allocs {allocations} peak_live_bytes {peak}"
    record_trace.write_trace(str(path), header, lines)
    return path
