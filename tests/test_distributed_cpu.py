"""What of gpumem's distributed support needs no GPU, on 2 CPU processes with gloo: the batch-size
finder's agreement across ranks (MIN of sizes, worst outcome wins) and gpumem.check_ranks, the fault
protocol (one rank's failure raised on every rank, a rank that vanishes gives the others an error
rather than a hang). Each rank is tests/dist_cpu_worker.py; a hang fails the test by its timeout."""
import json
import os
import socket
import subprocess
import sys

import pytest

pytest.importorskip("torch")
import torch.distributed as dist

if not dist.is_available():
    pytest.skip("torch.distributed is not available in this torch build", allow_module_level=True)

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dist_cpu_worker.py")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(scenario, world=2, timeout=120):
    """{rank: {check: result}} from `world` worker processes; fails if any runs past `timeout`."""
    port = str(_free_port())
    env = {k: v for k, v in os.environ.items() if k not in ("GPUMEM_CONF", "GPUMEM_DISABLE")}
    procs = [subprocess.Popen([sys.executable, WORKER, scenario, str(r), str(world), port], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(world)]
    results = {}
    for r, p in enumerate(procs):
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"rank {r} of scenario {scenario!r} still running after {timeout} s: a hang")
        rows = [json.loads(line[len("RESULT "):]) for line in out.splitlines() if line.startswith("RESULT ")]
        results[r] = {row.get("check", "done"): row for row in rows}
        results[r]["_returncode"] = p.returncode
        results[r]["_stderr"] = err[-2000:]
    return results


def test_agreement_and_check_ranks_on_two_ranks():
    got = _run("agree")
    for r in (0, 1):
        assert got[r]["_returncode"] == 0 and "done" in got[r], got[r]["_stderr"]
        assert got[r]["comm"] == {"check": "comm", "kind": "_DistComm", "rank": r, "world": 2}
        assert got[r]["not_distributed"]["kind"] == "_Comm"
        assert got[r]["min_int"]["value"] == 17                   # the smaller of 40 and 17
        assert got[r]["exchange"]["value"] == [1, 101, 7, 5]      # worst outcome, largest figures
        assert got[r]["none_failed"]["raised"] is None
        oom = got[r]["rank1_oom"]
        assert oom["raised"] == "RankOutOfMemoryError" and oom["is_torch_oom"]
        assert oom["failures"] == {"1": "out of memory"}
        assert "rank 1: out of memory" in oom["message"] and f"rank {r}" in oom["message"]
        assert oom["cause"] == ("OutOfMemoryError" if r == 1 else None)
        err = got[r]["rank0_error"]
        assert err["raised"] == "RankFailure" and not err["is_torch_oom"]
        assert err["failures"] == {"0": "error"}
        both = got[r]["both"]
        assert both["raised"] == "RankOutOfMemoryError"
        assert both["failures"] == {"0": "error", "1": "out of memory"}
        assert got[r]["after"]["value"] == [2.0, 2.0, 2.0]       # the ranks carried on together
        assert got[r]["bad_argument"]["raised"] == "TypeError"
        assert "str" in got[r]["bad_argument"]["message"]


def test_a_vanished_rank_gives_the_others_an_error_not_a_hang():
    got = _run("crash", timeout=60)
    assert got[1]["_returncode"] == 0 and "crash" not in got[1]
    crash = got[0].get("crash")
    assert crash is not None, got[0]["_stderr"]
    assert crash["raised"] is not None, crash
    assert crash["seconds"] < 40, crash  # the process group's timeout is 20 s


def test_check_ranks_without_a_process_group():
    import gpumem

    with pytest.raises(RuntimeError, match="not initialized"):
        gpumem.check_ranks(None)
