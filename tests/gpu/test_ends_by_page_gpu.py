"""The pool's options ends_by_page (GPUMEM_CONF ends_by_page, off by default) and early_ends_by_page (0.1
by default) on a GPU (core/pool_map.cpp, ensure_mapped): under a memory fraction that is not roomy, a
block's end groups are mapped page by page on the real driver (every block's with ends_by_page, those
of the blocks mapped while the live high water is below 10% of the fraction by default), and what it
maps holds the right values under pressure. Each test runs a child process with gpumem as torch's
allocator, with ends_by_page, with the defaults and with early_ends_by_page:0:

- two 9 MiB tensors side by side under a 1 GiB fraction (18 MiB: early blocks): the first covers one
  8 MiB group and one page of the next, which it shares with the second. Once the second is freed and
  the cache emptied, the first pins one 2 MiB page of that group with ends_by_page and with the
  defaults, the whole 8 MiB group with early_ends_by_page:0: 6 MiB more reserved
  (tests/test_pool_placement.py shows the same on the simulated device);
- tensors of changing sizes under a fraction just above their peak, each filled with a value of its
  own and every live one checked after every step (a page mapped twice or backing two tensors would
  show as a wrong value; checked by each tensor's min and max, which allocate nothing of its size),
  out-of-memory errors caught and the step going on; afterwards nothing is allocated, and
  empty_cache gives every page back.

Run: pytest -m gpu tests/gpu/test_ends_by_page_gpu.py"""
import functools

import pytest
from _run import child_facts

CHILD = r"""
import json, random
import gpumem, gpumem._torch as gt
import torch
assert gt.is_active(), gt.status_line()
MiB = 1 << 20
total = torch.cuda.mem_get_info()[1]
facts = {"conf": gt.active_config()["ends_by_page"], "early": gt.active_config()["early_ends_by_page"]}

# 1. Two 9 MiB tensors side by side, the second freed.
torch.cuda.set_per_process_memory_fraction(1024 * MiB / total)
a = torch.full((9 * MiB,), 7, dtype=torch.uint8, device="cuda")
b = torch.full((9 * MiB,), 9, dtype=torch.uint8, device="cuda")
facts["adjacent"] = b.data_ptr() == a.data_ptr() + 9 * MiB
del b
torch.cuda.synchronize()
torch.cuda.empty_cache()
facts["reserved_after_free"] = torch.cuda.memory_reserved()
facts["a_intact"] = int(a.min()) == 7 == int(a.max())
del a
torch.cuda.empty_cache()
facts["reserved_empty"] = torch.cuda.memory_reserved()

# 2. Tensors of changing sizes under a fraction just above their peak.
torch.cuda.set_per_process_memory_fraction(1.0)
torch.cuda.reset_peak_memory_stats()
def run(seed, ooms):
    rng = random.Random(seed)
    live, checks = [], 0
    for step in range(300):
        for _ in range(rng.randint(0, 3)):
            if live:
                live.pop(rng.randrange(len(live)))
        for _ in range(rng.randint(0, 3)):
            n = rng.randint(1, 2 * MiB) if rng.random() < 0.4 else rng.randint(2 * MiB, 40 * MiB)
            value = rng.randint(1, 255)
            try:
                t = torch.empty(n, dtype=torch.uint8, device="cuda")
            except torch.cuda.OutOfMemoryError:
                ooms.append(step)
                continue
            t.fill_(value)
            live.append((t, value))
        del live[:-24]
        # min and max allocate no tensor of t's size (t == v would, and run out of memory itself)
        wrong = [i for i, (t, v) in enumerate(live) if not int(t.min()) == v == int(t.max())]
        assert not wrong, f"step {step}: tensors {wrong} do not hold their values"
        checks += len(live)
    return checks
run(0, [])  # uncapped: the peak
peak = torch.cuda.max_memory_allocated()
torch.cuda.synchronize()
torch.cuda.empty_cache()
torch.cuda.set_per_process_memory_fraction(1.01 * peak / total)
ooms = []
facts["checks"] = run(0, ooms)
facts["ooms"] = len(ooms)
facts["allocated_after"] = torch.cuda.memory_allocated()
torch.cuda.synchronize()
torch.cuda.empty_cache()
facts["reserved_after"] = torch.cuda.memory_reserved()
gpumem.validate()
print("FACTS " + json.dumps(facts))
"""


@functools.lru_cache(maxsize=None)
def run_child(conf):
    return child_facts(CHILD, conf)


@pytest.mark.gpu
def test_under_a_fraction_an_early_blocks_end_pages_go_back_by_default_and_with_ends_by_page():
    on, default, off = run_child("ends_by_page:true"), run_child(""), run_child("early_ends_by_page:0")
    print("ends_by_page:", on, "\ndefault:", default, "\nearly_ends_by_page:0:", off)
    assert on["conf"] is True and default["conf"] is False and off["conf"] is False
    assert default["early"] == 0.1 and off["early"] == 0.0
    for facts in (on, default, off):
        assert facts["adjacent"] and facts["a_intact"] and facts["reserved_empty"] == 0, facts
    MiB = 1 << 20
    # the second tensor's pages of the shared group went back with either option, stayed pinned without
    assert on["reserved_after_free"] == default["reserved_after_free"] == 10 * MiB
    assert off["reserved_after_free"] == 16 * MiB


@pytest.mark.gpu
def test_under_a_tight_fraction_every_tensor_keeps_its_values_and_nothing_is_left():
    for conf in ("ends_by_page:true", "", "early_ends_by_page:0"):
        facts = run_child(conf)
        assert facts["checks"] > 1000, facts
        assert facts["allocated_after"] == 0 and facts["reserved_after"] == 0, facts
