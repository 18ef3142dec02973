"""gpumem under PyTorch's distributed training: FSDP2 and DDP over NCCL, one process per GPU under
torchrun, with as many ranks as the machine has GPUs (NCCL runs with one rank too). What only several
ranks can show (agreement between ranks that differ, a failure on one rank reaching the others) is
marked ``multigpu`` and skipped, saying so, with fewer than 2 GPUs.

Scripts (each a torchrun program printing ``RESULT {json}`` per rank):
  bench/fsdp_bench.py            FSDP2 training per allocator (losses, reserved, step time)
  tests/gpu/dist_nccl_register.py  collectives with ProcessGroupNCCL's register hook on and off
  tests/gpu/dist_batch_size.py   find_batch_size under FSDP2, and under DDP with uneven budgets
  tests/gpu/dist_faults.py       one rank out of memory inside a step: recover together, or stop
"""
import json
import os
import re
import shutil
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
import _run  # noqa: E402

pytestmark = pytest.mark.gpu


def _gpus():
    import torch

    return torch.cuda.device_count()


def _torchrun(script_args, timeout, nproc=None, **env):
    """(results by rank, stdout, stderr, returncode): torchrun on this machine's GPUs, killed (and the
    test failed) if it runs past `timeout` seconds."""
    torchrun = shutil.which("torchrun")
    cmd = [torchrun] if torchrun else [sys.executable, "-m", "torch.distributed.run"]
    cmd += ["--standalone", "--nproc_per_node", str(nproc or _gpus()), *map(str, script_args)]
    proc = _run.start(cmd, _run.clean_env(**env))
    out, err, timed_out = _run.finish(proc, timeout)
    assert not timed_out, f"torchrun still running after {timeout} s (a hang):\n{out[-3000:]}\n{err[-3000:]}"
    results = {row["rank"]: row for row in _run.read_results(out)}
    return results, out, err, proc.returncode


def _raised(err):
    """The lines of the ranks' stderr that name an exception (a traceback's last line), for a failure's
    message: the tail alone can end in torchrun's own report, cutting the rank's error off."""
    return [line for line in err.splitlines() if re.search(r"\b\w*(Error|Exception)\b: ", line)][-6:]


def _must_succeed(rc, out, err):
    """Fails the test, with the ranks' exception lines first and the tails of both streams whole, when
    torchrun exited with an error (an assertion's message would be cut short: at d5912df the one
    exception line that said why ended mid-number)."""
    if rc != 0:
        pytest.fail(f"torchrun exited with {rc}\n" + "\n".join(_raised(err))
                    + f"\n--- stdout (tail) ---\n{out[-3000:]}\n--- stderr (tail) ---\n{err[-8000:]}",
                    pytrace=False)


def _need_two():
    if _gpus() < 2:
        pytest.skip("needs 2 GPUs (one rank per GPU): run on a machine with several GPUs")


# ---- FSDP2 training: gpumem's losses are PyTorch's, reserved flat ------------------------------------

def test_fsdp2_training_losses_equal_native_and_reserved_flat(tmp_path):
    bench = os.path.join(ROOT, "bench", "fsdp_bench.py")
    common = ["--steps", "40", "--warmup", "10", "--layers", "4", "--width", "512", "--heads", "8",
              "--batch", "4", "--seq", "512"]
    runs = {}
    for allocator in ("native", "gpumem"):
        out_file = tmp_path / f"fsdp_{allocator}.json"
        args = [bench, "--allocator", allocator, "--out", out_file, *common]
        _, out, err, rc = _torchrun(args, timeout=300)
        _must_succeed(rc, out, err)
        runs[allocator] = out_file
    cmd = [sys.executable, bench, "--compare", str(runs["native"]), str(runs["gpumem"])]
    r = _run.start(cmd, os.environ.copy())
    out, err, _ = _run.finish(r, 60)
    result = json.loads(out.splitlines()[-1])
    rows = [row for row in result["rows"] if row["allocator"] == "gpumem"]
    assert len(rows) == _gpus()
    assert result["losses_identical"], out
    for row in rows:
        assert row["flat"], row  # reserved after warm-up grew by no more than one 20 MiB segment
    print(out)


# ---- NCCL's register hook: off on gpumem's pages, on (whole segments registered) with upstream:segments ---

@pytest.mark.parametrize("hook,conf,in_effect", [
    ("0", "", "0"),
    # On CUDA virtual memory gpumem turns the hook off at import (with it on, two ranks failed 3 runs of 5
    # with an illegal memory access: NCCL shares a registered segment as one physical allocation).
    ("1", "", "0"),
    ("1", "upstream:segments", "1"),  # whole cudaMalloc segments: the hook stays on, NCCL registers them
])
def test_nccl_collectives_on_gpumem_memory_with_register_hook(hook, conf, in_effect):
    script = os.path.join(HERE, "dist_nccl_register.py")
    env = dict(TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK=hook, GPUMEM_CONF=conf)
    results, out, err, rc = _torchrun([script, "gpumem"], timeout=240, **env)
    _must_succeed(rc, out, err)
    assert sorted(results) == list(range(_gpus()))
    if hook != in_effect:
        assert "TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK=1 turned off" in err, err[-3000:]
    for row in results.values():
        assert row["hook"] == hook and row["hook_in_effect"] == in_effect, row
        assert row["checked"] == 24 and row["wrong"] == 0, row
        # What trackers were told is what NCCL's hooks act on: exact, and NCCL's own hook raised nothing.
        assert row["mismatches"] == 0 and row["tracker_errors"] == 0, row
        assert row["audit_equals_snapshot"], row
        assert row["allocs"] > 0 and row["frees"] > 0, row
        assert all(b > a for a, b in zip(row["frees_per_round"], row["frees_per_round"][1:])), row
    print(json.dumps(results))


def test_nccl_register_hook_reference_run_with_pytorchs_allocator():
    # The same script on PyTorch's allocator: if this fails too, the trouble is not gpumem's.
    script = os.path.join(HERE, "dist_nccl_register.py")
    results, out, err, rc = _torchrun([script, "native"], timeout=240,
                                      TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK="1")
    _must_succeed(rc, out, err)
    assert all(row["wrong"] == 0 and row["checked"] == 24 for row in results.values()), results


# ---- find_batch_size across ranks ----------------------------------------------------------------------

def test_find_batch_size_under_fsdp2_same_answer_inside_budget():
    results, out, err, rc = _torchrun([os.path.join(HERE, "dist_batch_size.py"), "fsdp"], timeout=420)
    _must_succeed(rc, out, err)
    assert sorted(results) == list(range(_gpus()))
    assert len({row["batch"] for row in results.values()}) == 1, results
    for row in results.values():
        assert row["batch"] >= 1 and row["world_size"] == _gpus()
        assert row["fits"], row  # 3 steps at the answer: max reserved inside the budget
    print(json.dumps(results))


@pytest.mark.multigpu
def test_find_batch_size_ddp_uneven_budgets_least_memory_decides():
    _need_two()
    results, out, err, rc = _torchrun([os.path.join(HERE, "dist_batch_size.py"), "uneven"], timeout=420)
    _must_succeed(rc, out, err)
    print(json.dumps(results))  # whole, in the captured output of a failure (each search's figures)
    agreed = {row["agreed"] for row in results.values()}
    assert len(agreed) == 1, results
    answer = agreed.pop()
    smallest = min(results, key=lambda r: results[r]["budget"])
    # Each rank's own answers, searched alone before and after the agreed search. Within a percent of the
    # cap, what gpumem's pool fits varies from run to run (not explained yet: one candidate is that pages
    # freed under pressure go back as the device passes their last use, at the device's pace): on two
    # H200s (3bdad27) the last rank's three searches answered 15,563, 15,563 (agreed) and 13,201, and the
    # agreed size ran under that rank's cap. The agreed size is the smallest rank's own answer in one of
    # its searches.
    own = (results[0]["locals"][smallest], results[0]["locals_after"][smallest])
    assert any(abs(answer - o) <= 1 for o in own), results
    assert answer < max(results[0]["locals"]), results
    assert all(row["fits"] for row in results.values()), results


# ---- one rank out of memory inside a step --------------------------------------------------------------

def test_one_rank_oom_every_rank_recovers_together():
    results, out, err, rc = _torchrun([os.path.join(HERE, "dist_faults.py"), "recover"], timeout=240)
    _must_succeed(rc, out, err)
    world = _gpus()
    assert sorted(results) == list(range(world))
    for row in results.values():
        assert row["skipped"] == [2] and row["done"] == [0, 1, 3, 4, 5], row
        assert len(set(row["param_sums"])) == 1, row  # the ranks' parameters stayed equal
        (raised,) = row["raised"]
        if world > 1:
            assert raised["type"] == "RankOutOfMemoryError", raised
            assert raised["failures"] == {str(world - 1): "out of memory"}, raised
        else:
            assert raised["type"] == "OutOfMemoryError", raised
    print(json.dumps(results))


def test_one_rank_oom_inside_fsdp2_step_ends_the_job_without_hanging():
    results, out, err, rc = _torchrun([os.path.join(HERE, "dist_faults.py"), "crash"], timeout=240)
    assert rc != 0, (out[-3000:], err[-3000:])
    assert "OutOfMemoryError" in out + err, (out[-3000:], err[-3000:])
    assert not results  # no rank finished the 5 steps


@pytest.mark.multigpu
def test_one_rank_oom_reaches_the_other_ranks():
    # The multi-rank halves of the two tests above, run again to say so in the test list.
    _need_two()
    results, out, err, rc = _torchrun([os.path.join(HERE, "dist_faults.py"), "recover"], timeout=240)
    _must_succeed(rc, out, err)
    for row in results.values():
        assert row["raised"][0]["type"] == "RankOutOfMemoryError"
        assert f"rank {_gpus() - 1}: out of memory" in row["raised"][0]["message"]
    results, out, err, rc = _torchrun([os.path.join(HERE, "dist_faults.py"), "crash"], timeout=240)
    assert rc != 0 and not results
    for r in range(_gpus() - 1):  # the ranks that did not fail got through steps 0 and 1, no further
        assert f"RANK {r} step 1 done" in out and f"RANK {r} step 2 done" not in out, out[-3000:]
