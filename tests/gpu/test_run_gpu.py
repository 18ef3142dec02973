"""``gpumem run`` on a GPU: unchanged scripts that train on CUDA, run as a user runs them (real
subprocesses from a folder outside the repository, the scripts written here, no mocks).

* ``python -m gpumem run train.py ARGS``: inside the script gpumem is torch's allocator, the script is
  ``__main__`` with ``sys.argv`` as given, it trains (losses bitwise equal to ``python train.py`` with
  PyTorch's own allocator), exit status 0;
* a script that runs out of memory: exit status 1, its traceback ending in ``OutOfMemoryError``;
* the ``gpumem`` console script, where pip installed one;
* ``torchrun --standalone --nproc_per_node 1`` starting ``python -m gpumem run`` (``torchrun -m``) and
  the ``gpumem`` program (``torchrun --no-python``): NCCL process group, a DDP step, an all_reduce;
* ``GPUMEM_CONF`` reaching the script's pool (its cap);
* ``--cupy`` / ``--numba``: the script finds CuPy / Numba allocating from gpumem's pool (skipped,
  saying so, where the library is absent).

The CPU side (argv, ``-m``, exit codes, usage errors) is tests/test_run_cli.py.
Run: pytest -m gpu tests/gpu/test_run_gpu.py (about a minute on an H100).
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest
from _run import clean_env, finish, start

pytestmark = pytest.mark.gpu

# Every child is killed (and the test failed) past this; each takes ~5-20 s on an H100.
TIMEOUT = 120

# What the scripts print about themselves: one line, "REPORT {json}", read back by report().
REPORT_FN = """
import json, sys
GPUMEM_FIRST = "gpumem" in sys.modules          # before the script's own imports

def report(**facts):
    import gpumem, torch
    facts.update(argv=sys.argv, name=__name__, file=__file__, gpumem_first=GPUMEM_FIRST,
                 active=gpumem.is_active(), status=gpumem.status_line(),
                 max_allocated=torch.cuda.max_memory_allocated(),
                 allocated=torch.cuda.memory_allocated(),
                 pool_allocated=(gpumem.stats(0)["allocated_bytes.all.current"] if gpumem.is_active()
                                 else None))
    print("REPORT " + json.dumps(facts), flush=True)
"""

# A small MLP trained for a few steps on one fixed batch. No embedding, no dropout, no attention: every
# kernel is deterministic, so the losses are the same bits whichever allocator served the memory.
TRAIN = REPORT_FN + """
import argparse
import torch
from torch import nn


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--width", type=int, default=512)
    args = p.parse_args()
    torch.manual_seed(0)
    dev = torch.device("cuda")
    model = nn.Sequential(nn.Linear(256, args.width), nn.GELU(), nn.LayerNorm(args.width),
                          nn.Linear(args.width, args.width), nn.GELU(), nn.Linear(args.width, 10)).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    x = torch.randn(128, 256, device=dev)
    y = torch.randint(0, 10, (128,), device=dev)
    losses = []
    for _ in range(args.steps):
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    import gpumem
    if gpumem.is_active():
        gpumem.validate()                       # the pool's structures after real training
    report(losses=losses, main_block=True)


if __name__ == "__main__":
    main()
"""

OOM = """
import torch
torch.cuda.set_per_process_memory_fraction(0.02)
total = torch.cuda.get_device_properties(0).total_memory
small = torch.ones(1 << 20, device="cuda")              # fits
print("BEFORE OOM", flush=True)
big = torch.empty(int(total * 0.05), dtype=torch.uint8, device="cuda")
print("NOT REACHED", flush=True)
"""

CONF = REPORT_FN + """
import torch
import gpumem
MiB = 1 << 20
ok = torch.empty(256 * MiB, dtype=torch.uint8, device="cuda")
try:
    torch.empty(1536 * MiB, dtype=torch.uint8, device="cuda")
    refused = False
except torch.cuda.OutOfMemoryError:
    refused = True
report(cap=gpumem.cap(), cap_bytes=gpumem.stats(0)["gpumem.cap_bytes"], refused_past_cap=refused,
       reserved=gpumem.stats(0)["reserved_bytes.all.current"])
"""

DDP = REPORT_FN + """
import os
import torch
import torch.distributed as dist
from torch import nn


def main():
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dev = torch.device("cuda", local)
    dist.init_process_group("nccl", device_id=dev)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 10)).to(dev)
    ddp = nn.parallel.DistributedDataParallel(model, device_ids=[local])
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    x = torch.randn(64, 256, device=dev)
    y = torch.randint(0, 10, (64,), device=dev)
    losses = []
    for _ in range(3):
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(ddp(x), y)
        loss.backward()                         # DDP's gradient all_reduce over NCCL
        opt.step()
        losses.append(loss.item())
    t = torch.full((1 << 20,), float(rank + 1), device=dev)
    dist.all_reduce(t)
    torch.cuda.synchronize()
    dist.barrier()
    dist.destroy_process_group()
    report(rank=rank, world=world, losses=losses, all_reduce=float(t[0]),
           all_reduce_expected=world * (world + 1) / 2, all_reduce_uniform=bool((t == t[0]).all()))


if __name__ == "__main__":
    main()
"""

# numba-cuda 0.30 and older break with NumPy 2.5 (np.row_stack removed; see test_integrations_gpu.py).
NUMPY_COMPAT = """
import numpy
if not hasattr(numpy, "row_stack"):
    numpy.row_stack = numpy.vstack
"""

CUPY = REPORT_FN + """
import cupy
import gpumem.cupy
MiB = 1 << 20
before = gpumem.stats(0)["gpumem.library.cupy.current"]
x = cupy.ones(16 * MiB, dtype=cupy.float32)
after = gpumem.stats(0)["gpumem.library.cupy.current"]
report(cupy_used=gpumem.cupy.is_used(), path=gpumem.cupy.path(), allocator=repr(cupy.cuda.get_allocator()),
       cupy_bytes=after - before, sum=float(x.sum()))
"""

NUMBA = REPORT_FN + NUMPY_COMPAT + """
import os
import numpy as np
from numba import cuda
import gpumem
MiB = 1 << 20
before = gpumem.stats(0)["gpumem.library.numba.current"]
d = cuda.device_array(16 * MiB, dtype=np.float32)
after = gpumem.stats(0)["gpumem.library.numba.current"]
report(env=os.environ.get("NUMBA_CUDA_MEMORY_MANAGER"),
       manager=type(cuda.current_context().memory_manager).__name__, numba_bytes=after - before)
"""

MiB = 1 << 20
BANNER = "gpumem: active as torch's CUDA allocator"


@pytest.fixture
def cwd(tmp_path) -> Path:
    d = tmp_path / "work"
    d.mkdir()
    return d


def write(tmp_path: Path, name: str, text: str) -> Path:
    d = tmp_path / "scripts"
    d.mkdir(exist_ok=True)
    p = d / name
    p.write_text(textwrap.dedent(text))
    return p


def call(cmd, cwd: Path, timeout: int = TIMEOUT, **env):
    """(returncode, stdout, stderr) of `cmd` run from `cwd` in a process group of its own, killed and the
    test failed past `timeout` seconds."""
    proc = start([str(c) for c in cmd], clean_env(**env), cwd=cwd)
    out, err, timed_out = finish(proc, timeout)
    assert not timed_out, (f"{cmd} still running after {timeout} s:\n"
                           f"stdout:\n{out[-3000:]}\nstderr:\n{err[-3000:]}")
    return proc.returncode, out, err


def gpumem_run(*args, cwd: Path, **env):
    return call([sys.executable, "-m", "gpumem", "run", *args], cwd, **env)


def report(out: str, err: str = "") -> dict:
    lines = [x for x in out.splitlines() if x.startswith("REPORT ")]
    assert len(lines) == 1, f"expected one REPORT line\nstdout:\n{out[-3000:]}\nstderr:\n{err[-3000:]}"
    return json.loads(lines[0][len("REPORT "):])


def console_script() -> str | None:
    """The `gpumem` program pip installed beside this Python, else on PATH."""
    path = Path(sysconfig.get_path("scripts")) / "gpumem"
    return str(path) if path.is_file() else shutil.which("gpumem")


def check_trained(rep: dict, argv: list, steps: int) -> None:
    assert rep["argv"] == argv
    assert rep["name"] == "__main__" and rep["main_block"] is True
    assert rep["gpumem_first"] is True, "gpumem was not imported before the script"
    assert rep["active"] is True, rep["status"]
    assert rep["max_allocated"] > 0
    assert rep["allocated"] == rep["pool_allocated"]  # torch's figures are gpumem's pool's
    losses = rep["losses"]
    assert len(losses) == steps and all(v == v and abs(v) != float("inf") for v in losses), losses
    assert losses[-1] < losses[0], losses  # one fixed batch: the model fits it


def test_python_m_gpumem_run_trains_as_python_script_would(tmp_path, cwd):
    script = write(tmp_path, "train.py", TRAIN)
    argv = [str(script), "--steps", "8", "--width", "384"]
    rc, out, err = gpumem_run(*argv, cwd=cwd)
    assert rc == 0, f"stdout:\n{out}\nstderr:\n{err}"
    assert BANNER in err.splitlines(), err  # gpumem run's banner, gpumem.status_line()
    rep = report(out, err)
    check_trained(rep, argv, 8)
    assert os.path.samefile(rep["file"], script)
    # The same script with PyTorch's own allocator: same argv handling, the same losses to the bit.
    rc, out, err = call([sys.executable, *argv], cwd, GPUMEM_DISABLE="1")
    assert rc == 0, f"stdout:\n{out}\nstderr:\n{err}"
    direct = report(out, err)
    assert direct["active"] is False and direct["gpumem_first"] is False
    assert direct["argv"] == rep["argv"] and direct["name"] == "__main__"
    assert direct["losses"] == rep["losses"]


def test_a_script_out_of_memory_exits_1_with_its_traceback(tmp_path, cwd):
    script = write(tmp_path, "oom.py", OOM)
    rc, out, err = gpumem_run("--quiet", script, cwd=cwd)
    assert rc == 1, f"stdout:\n{out}\nstderr:\n{err}"
    assert "BEFORE OOM" in out and "NOT REACHED" not in out
    assert "Traceback (most recent call last):" in err
    assert f'File "{script}", line ' in err  # the script's frame...
    assert "runpy" not in err and "gpumem/run.py" not in err  # ...not the launcher's
    last = err.rstrip().splitlines()[-1]
    assert re.match(r"torch\.(cuda\.)?OutOfMemoryError: ", last), last


def test_the_gpumem_console_script_runs_a_training_script(tmp_path, cwd):
    exe = console_script()
    if exe is None:
        pytest.skip("no `gpumem` program installed beside this Python or on PATH (gpumem not installed "
                    "with pip)")
    script = write(tmp_path, "train.py", TRAIN)
    argv = [str(script), "--steps", "5"]
    rc, out, err = call([exe, "run", "--quiet", *argv], cwd)
    assert rc == 0, f"stdout:\n{out}\nstderr:\n{err}"
    check_trained(report(out, err), argv, 5)


def test_gpumem_conf_sets_the_scripts_pool(tmp_path, cwd):
    script = write(tmp_path, "conf.py", CONF)
    rc, out, err = gpumem_run("--quiet", script, cwd=cwd, GPUMEM_CONF="cap:1GiB")
    assert rc == 0, f"stdout:\n{out}\nstderr:\n{err}"
    rep = report(out, err)
    assert rep["active"] is True, rep["status"]
    assert rep["cap"] == 1024 * MiB and rep["cap_bytes"] == 1024 * MiB
    assert rep["refused_past_cap"] is True  # 256 MiB live + 1.5 GiB would pass the 1 GiB cap
    assert 256 * MiB <= rep["reserved"] <= 1024 * MiB
    # Without GPUMEM_CONF there is no cap and the same request fits.
    rc, out, err = gpumem_run("--quiet", script, cwd=cwd)
    assert rc == 0, f"stdout:\n{out}\nstderr:\n{err}"
    rep = report(out, err)
    assert rep["cap"] == 0 and rep["refused_past_cap"] is False


def _torchrun_cmd(launcher: str, script: Path, args: list) -> list:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1"]
    if launcher == "module":  # torchrun starts `python -u -m gpumem run ...`
        return [*cmd, "-m", "gpumem", "run", script, *args]
    exe = console_script()
    if exe is None:
        pytest.skip("no `gpumem` program installed beside this Python or on PATH: torchrun --no-python "
                    "needs it (gpumem not installed with pip)")
    return [*cmd, "--no-python", exe, "run", script, *args]


@pytest.mark.parametrize("launcher", ["module", "no-python"])
def test_torchrun_one_process_ddp_and_all_reduce(tmp_path, cwd, launcher):
    script = write(tmp_path, "ddp.py", DDP)
    rc, out, err = call(_torchrun_cmd(launcher, script, ["--tag", "x"]), cwd)
    assert rc == 0, f"stdout:\n{out[-4000:]}\nstderr:\n{err[-4000:]}"
    assert BANNER in err.splitlines(), err[-4000:]  # the banner, from the rank
    rep = report(out, err)
    assert rep["rank"] == 0 and rep["world"] == 1
    assert rep["argv"] == [str(script), "--tag", "x"] and rep["name"] == "__main__"
    assert rep["gpumem_first"] is True and rep["active"] is True, rep["status"]
    assert rep["allocated"] == rep["pool_allocated"] and rep["max_allocated"] > 0
    assert rep["all_reduce"] == rep["all_reduce_expected"] == 1.0 and rep["all_reduce_uniform"]
    assert len(rep["losses"]) == 3 and rep["losses"][-1] < rep["losses"][0], rep["losses"]


def _need(module: str, package: str) -> None:
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{package} is not installed on this machine")


def test_cupy_flag_makes_gpumem_cupys_allocator(tmp_path, cwd):
    _need("cupy", "cupy")
    script = write(tmp_path, "with_cupy.py", CUPY)
    rc, out, err = gpumem_run("--quiet", "--cupy", script, cwd=cwd)
    assert rc == 0, f"stdout:\n{out}\nstderr:\n{err}"
    rep = report(out, err)
    assert rep["active"] is True, rep["status"]
    # The C path (CFunctionAllocator's malloc) where this CuPy allows it, else the Python closure.
    assert rep["cupy_used"] is True, rep
    assert ("CFunctionAllocator" if rep["path"] == "c" else "gpumem_cupy_malloc") in rep["allocator"], rep
    assert rep["cupy_bytes"] == 64 * MiB and rep["sum"] == 16 * MiB
    # Without the flag CuPy keeps its own pool: gpumem counts none of its bytes.
    rc, out, err = gpumem_run("--quiet", script, cwd=cwd)
    assert rc == 0, f"stdout:\n{out}\nstderr:\n{err}"
    rep = report(out, err)
    assert rep["cupy_used"] is False and rep["cupy_bytes"] == 0


def test_numba_flag_makes_gpumem_numbas_memory_manager(tmp_path, cwd):
    _need("numba", "numba-cuda")
    script = write(tmp_path, "with_numba.py", NUMBA)
    rc, out, err = gpumem_run("--quiet", "--numba", script, cwd=cwd)
    assert rc == 0, f"stdout:\n{out}\nstderr:\n{err}"
    rep = report(out, err)
    assert rep["active"] is True, rep["status"]
    assert rep["env"] == "gpumem.numba" and rep["manager"] == "GpumemNumbaMemoryManager"
    assert rep["numba_bytes"] == 64 * MiB
