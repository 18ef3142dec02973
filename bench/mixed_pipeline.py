"""A pipeline that mixes GPU libraries: CuPy preprocessing -> a torch step -> a Numba kernel, sizes
varying from round to round (0.1 to 6 GiB each by default, 24 rounds), run with

  own          each library's own pool (torch's caching allocator, CuPy's pool, Numba's allocator)
  gpumem       gpumem's pool serving all three (gpumem.cupy.use(), NUMBA_CUDA_MEMORY_MANAGER)
  rmm-pool     RMM's pool (PoolMemoryResource over cudaMalloc) serving all three   (if rmm is present)
  rmm-async    RMM's CudaAsyncMemoryResource (cudaMallocAsync) serving all three   (if rmm is present)

one process per configuration. Measured: the peak of device memory in use (cudaMemGetInfo after every
allocation step, minus what was in use before the first) and the peak of live bytes (what the
pipeline holds at that moment, counted by the pipeline itself); their ratio is the overhead of the
allocators. Then a cap run: the device is limited (a raw cudaMalloc ballast takes the rest) to a size
where gpumem's peak fits with a margin, and `own` and `gpumem` run again under it. Then the cost of
one CuPy operation's allocation (allocate + free, and a small elementwise op) through gpumem's C path
(CuPy's CFunctionAllocator over the bridge's C functions), through its Python path, and through
CuPy's own pool, and, with rmm, of one rmm.DeviceBuffer through gpumem's resource and
through RMM's pool.

    python bench/mixed_pipeline.py                 # the full run (a few minutes on an H100)
    python bench/mixed_pipeline.py --scale 0.25    # sizes 0.025 to 1.5 GiB: about a minute
    python bench/mixed_pipeline.py --ops-only      # only the cost per allocation (seconds)

Prints a table, then one JSON line. Needs torch with CUDA, cupy, numba-cuda; rmm is optional.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()
GiB = 1 << 30
MiB = 1 << 20
OOM_NAMES = ("OutOfMemoryError", "CudaAPIError", "MemoryError")


# ---- the child: one configuration ------------------------------------------------------------------

def setup(config: str):
    """Imports the libraries with `config`'s allocators; returns (cupy, torch, numba.cuda)."""
    # numba-cuda (0.30 and older) registers an overload of np.row_stack, which NumPy 2.5 removed: every
    # kernel launch then fails with AttributeError (NVIDIA/numba-cuda#907, not fixed upstream). The
    # GPU machine has that pair; np.row_stack was an alias of np.vstack, so it is put back before
    # numba loads. gpumem itself does not touch numpy.
    import numpy

    if not hasattr(numpy, "row_stack"):
        numpy.row_stack = numpy.vstack
    if config == "gpumem":
        import gpumem  # first: torch's allocator before CUDA starts

        assert gpumem.is_active(), gpumem.status_line()
        import gpumem.cupy

        gpumem.cupy.use()  # (NUMBA_CUDA_MEMORY_MANAGER=gpumem.numba set by the parent)
    elif config.startswith("rmm"):
        import rmm
        import torch
        from rmm.allocators.torch import rmm_torch_allocator

        if config == "rmm-pool":
            rmm.mr.set_current_device_resource(
                rmm.mr.PoolMemoryResource(rmm.mr.CudaMemoryResource(), initial_pool_size=256 * MiB))
        else:
            rmm.mr.set_current_device_resource(rmm.mr.CudaAsyncMemoryResource())
        torch.cuda.memory.change_current_allocator(rmm_torch_allocator)
        import cupy
        from rmm.allocators.cupy import rmm_cupy_allocator

        cupy.cuda.set_allocator(rmm_cupy_allocator)
    import cupy
    import torch
    from numba import cuda

    return cupy, torch, cuda


def sizes(rounds: int, scale: float, seed: int):
    """Per round, the CuPy input's and the torch step's bytes: log-uniform in [0.1, 6] GiB * scale."""
    rng = random.Random(seed)
    lo, hi = math.log(0.1 * GiB * scale), math.log(6 * GiB * scale)
    return [(int(math.exp(rng.uniform(lo, hi))) // 4096 * 4096,
             int(math.exp(rng.uniform(lo, hi))) // 4096 * 4096) for _ in range(rounds)]


def pipeline(config: str, rounds: int, scale: float, seed: int, device_limit: int) -> dict:
    cupy, torch, cuda = setup(config)

    @cuda.jit
    def scale_add(src, dst, k):
        i = cuda.grid(1)
        if i < src.size:
            dst[i] = src[i] * k + 1.0

    # Every library's context, and the kernel compiled, before the baseline.
    torch.zeros(1, device="cuda")
    w = cupy.zeros(256, dtype=cupy.float32)
    scale_add[1, 256](cuda.as_cuda_array(w), cuda.device_array(256, dtype="float32"), 1.0)
    cuda.synchronize()
    del w
    free0, total = cupy.cuda.runtime.memGetInfo()
    ballast = 0
    if device_limit and free0 > device_limit:
        ballast = cupy.cuda.runtime.malloc(free0 - device_limit)  # raw: the device has `limit` left
        free0, total = cupy.cuda.runtime.memGetInfo()
    peak_device = peak_live = live = 0

    def measure():
        nonlocal peak_device, peak_live
        cupy.cuda.runtime.deviceSynchronize()
        free, _ = cupy.cuda.runtime.memGetInfo()
        peak_device = max(peak_device, free0 - free)
        peak_live = max(peak_live, live)

    def held(obj, nbytes):
        """`obj`, just allocated, now held by the pipeline: counted live, the device measured."""
        nonlocal live
        live += nbytes
        measure()
        return obj

    def dropped(nbytes):
        nonlocal live
        live -= nbytes

    t0 = time.perf_counter()
    done, error = 0, ""
    try:
        for r, (s_cupy, s_torch) in enumerate(sizes(rounds, scale, seed)):
            n = s_cupy // 4
            half = 4 * (n // 2)
            # CuPy preprocessing: input, a scaled copy, half of it as the features.
            a = held(cupy.full(n, r + 1, dtype=cupy.float32), 4 * n)
            b = held(cupy.empty(n, dtype=cupy.float32), 4 * n)
            cupy.multiply(a, 2, out=b)
            feat = held(cupy.empty(n // 2, dtype=cupy.float32), half)
            cupy.add(b[: n // 2], 1, out=feat)
            del a, b
            dropped(8 * n)
            # The torch step: the features without a copy (DLPack), an activation of its own size.
            t = torch.from_dlpack(feat)
            h = held(torch.empty(s_torch // 4, dtype=torch.float32, device="cuda"), s_torch)
            h.fill_(1.0)
            y = held(t * 3, half)
            del h
            dropped(s_torch)
            # The Numba kernel: reads torch's result (CUDA array interface), writes its own array.
            out = held(cuda.device_array(n // 2, dtype="float32"), half)
            scale_add[(n // 2 + 255) // 256, 256](cuda.as_cuda_array(y), out, 0.5)
            expect = ((r + 1) * 2 + 1) * 3 * 0.5 + 1.0
            got = float(out[n // 2 - 1 : n // 2].copy_to_host()[0])
            if got != expect:
                raise AssertionError(f"round {r}: {got} != {expect}")
            del t, feat, y, out
            dropped(3 * half)
            done += 1
    except Exception as e:  # an OOM under the cap is a result; anything else is reported too
        error = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}" if str(e) else type(e).__name__
    seconds = time.perf_counter() - t0
    if ballast:
        cupy.cuda.runtime.free(ballast)
    return dict(config=config, ok=not error and done == rounds, rounds=done, error=error,
                oom=any(n in error for n in OOM_NAMES), peak_device=peak_device, peak_live=peak_live,
                ratio=peak_device / peak_live if peak_live else None, seconds=round(seconds, 2),
                device_limit=device_limit, device_total=total)


def op_cost(config: str, iterations: int) -> dict:
    """Microseconds per CuPy allocation + free (1 MiB) and per small elementwise op (4 KiB result),
    or, for rmm-*, per rmm.DeviceBuffer(1 MiB) made and dropped."""
    if config.startswith("rmm-op"):
        import rmm

        if config == "rmm-op-gpumem":
            import gpumem
            import gpumem.rmm

            assert gpumem.is_active(), gpumem.status_line()
            gpumem.rmm.use()
        else:
            rmm.mr.set_current_device_resource(rmm.mr.PoolMemoryResource(rmm.mr.CudaMemoryResource(),
                                                                          initial_pool_size=256 * MiB))
        for _ in range(100):
            rmm.DeviceBuffer(size=MiB)
        t0 = time.perf_counter()
        for _ in range(iterations):
            rmm.DeviceBuffer(size=MiB)
        return dict(config=config, buffer_us=(time.perf_counter() - t0) / iterations * 1e6)
    path = ""
    if config.startswith("op-gpumem"):  # op-gpumem-c, op-gpumem-python
        import gpumem
        import gpumem.cupy

        assert gpumem.is_active(), gpumem.status_line()
        gpumem.cupy.use(config.rsplit("-", 1)[1])
        path = gpumem.cupy.path()
    import cupy

    x = cupy.ones(1024, dtype=cupy.float32)
    for _ in range(100):  # warm: kernels compiled, blocks cached
        cupy.empty(MiB, dtype=cupy.uint8)
        x + 1
    cupy.cuda.runtime.deviceSynchronize()
    t0 = time.perf_counter()
    for _ in range(iterations):
        cupy.empty(MiB, dtype=cupy.uint8)
    alloc_us = (time.perf_counter() - t0) / iterations * 1e6
    t0 = time.perf_counter()
    for _ in range(iterations):
        x + 1
    cupy.cuda.runtime.deviceSynchronize()
    op_us = (time.perf_counter() - t0) / iterations * 1e6
    return dict(config=config, alloc_free_us=alloc_us, small_op_us=op_us, path=path)


# ---- the parent -------------------------------------------------------------------------------------

def child(config: str, args, device_limit: int = 0, what: str = "pipeline") -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("GPUMEM_CONF", "GPUMEM_DISABLE",
                                                             "NUMBA_CUDA_MEMORY_MANAGER")}
    if config in ("gpumem",):
        env["NUMBA_CUDA_MEMORY_MANAGER"] = "gpumem.numba"
    elif config.startswith("rmm") and what == "pipeline":
        env["NUMBA_CUDA_MEMORY_MANAGER"] = "rmm.allocators.numba"
    cmd = [sys.executable, str(HERE), "--child", config, "--what", what, "--rounds", str(args.rounds),
           "--scale", str(args.scale), "--seed", str(args.seed), "--device-limit", str(device_limit),
           "--iterations", str(args.iterations)]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if r.returncode != 0 or not lines:
        tail = (r.stderr or r.stdout).strip().splitlines()[-3:]
        return dict(config=config, ok=False, error=f"exit {r.returncode}: {' | '.join(tail)}"[:300])
    return json.loads(lines[-1])


def gib(n) -> str:
    return f"{n / GiB:7.2f}" if isinstance(n, (int, float)) else "      -"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=24)
    p.add_argument("--scale", type=float, default=1.0, help="sizes are [0.1, 6] GiB times this")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--iterations", type=int, default=20000, help="per-op benchmark iterations")
    p.add_argument("--timeout", type=int, default=300, help="seconds per child process")
    p.add_argument("--skip-cap", action="store_true", help="no cap run")
    p.add_argument("--ops-only", action="store_true", help="only the cost per allocation (no pipeline)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--what", default="pipeline", help=argparse.SUPPRESS)
    p.add_argument("--device-limit", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        res = (pipeline(args.child, args.rounds, args.scale, args.seed, args.device_limit)
               if args.what == "pipeline" else op_cost(args.child, args.iterations))
        print(json.dumps(res))
        return 0

    # rmm counts only where it imports (its wheels need cuda-bindings 13 and numpy 2); said either way.
    probe = subprocess.run([sys.executable, "-c", "import rmm"], capture_output=True, text=True, timeout=300)
    have_rmm = probe.returncode == 0
    if not have_rmm:
        print(f"(rmm left out: {(probe.stderr.strip().splitlines() or ['?'])[-1]})")
    configs = ["own", "gpumem"] + (["rmm-pool", "rmm-async"] if have_rmm else [])
    results = {} if args.ops_only else {c: child(c, args) for c in configs}
    cap_runs = {}
    g = results.get("gpumem", {})
    if not args.skip_cap and g.get("ok"):
        # gpumem's own peak plus 10% and a page of slack, in 256 MiB steps.
        limit = math.ceil((g["peak_device"] * 1.10 + 64 * MiB) / (256 * MiB)) * 256 * MiB
        cap_runs = {c: child(c, args, device_limit=limit) for c in ("own", "gpumem")}
    op_configs = ["op-own", "op-gpumem-c", "op-gpumem-python"]
    ops = {c: child(c, args, what="op") for c in op_configs}
    if have_rmm:
        ops.update({c: child(c, args, what="op") for c in ["rmm-op-pool", "rmm-op-gpumem"]})

    if results:
        print(f"mixed pipeline: CuPy -> torch -> Numba, {args.rounds} rounds, sizes "
              f"{0.1 * args.scale:g}-{6 * args.scale:g} GiB (seed {args.seed})")
        print(f"{'configuration':<14} {'peak device GiB':>16} {'peak live GiB':>14} {'ratio':>7}  "
              f"{'s':>6}  result")
    for c, r in results.items():
        ratio = f"{r['ratio']:.2f}x" if r.get("ratio") else "-"
        print(f"{c:<14} {gib(r.get('peak_device')):>16} {gib(r.get('peak_live')):>14} {ratio:>7}  "
              f"{r.get('seconds', 0):6.1f}  {'ok' if r.get('ok') else r.get('error')}")
    if cap_runs:
        limit = next(iter(cap_runs.values())).get("device_limit", 0)
        print(f"\nunder a device limited to {limit / GiB:.2f} GiB (a raw cudaMalloc takes the rest):")
        for c, r in cap_runs.items():
            state = "ok" if r.get("ok") else f"failed at round {r.get('rounds')}: {r.get('error')}"
            print(f"  {c:<12} {state}")
    print("\nallocation cost per CuPy op (us; op-own: CuPy's own MemoryPool):")
    for c in op_configs:
        r = ops[c]
        if "alloc_free_us" in r:
            print(f"  {c:<17} empty(1 MiB)+free {r['alloc_free_us']:6.2f}   x + 1 (1024 floats) "
                  f"{r['small_op_us']:6.2f}")
        else:
            print(f"  {c:<17} {r.get('error')}")
    for c in ("rmm-op-pool", "rmm-op-gpumem"):
        if c in ops:
            r = ops[c]
            print(f"  {c:<14} DeviceBuffer(1 MiB) {r['buffer_us']:6.2f}" if "buffer_us" in r
                  else f"  {c:<14} {r.get('error')}")
    print(json.dumps(dict(bench="mixed_pipeline", rounds=args.rounds, scale=args.scale, seed=args.seed,
                          results=results, cap=cap_runs, ops=ops)))
    ok = all(r.get("ok") for r in results.values()) and all("alloc_free_us" in ops[c] for c in op_configs)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
