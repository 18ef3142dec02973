"""Build the snapshots bundled for ``gpumem report`` (python/gpumem/report/examples/) from a trace replay.

No GPU is needed and none is pretended: the allocations, frees and their sizes are those of the
bundled ResNet-50 trace (recorded from real PyTorch training on an H200), replayed through gpumem's
pool on a simulated device of 8 GiB; segments, blocks, maps, unmaps and the OOM are what that pool
really did. Two things are SYNTHESIZED, because a trace has neither: the stacks (a plausible
ResNet-50 training script's Python and C++ frames, picked per allocation from its lifetime: the
model's parameters, gradients, Adam's state, saved activations, backward temporaries) and the times
(25 microseconds per operation). The replay stops in the 3rd iteration at its peak, after an
``empty_cache()`` at the end of the 1st, and asks for a 4 GiB batch that does not fit (the OOM).

    python tools/make_report_examples.py             # rewrites the two bundled snapshots
    python tools/make_report_examples.py --events 1000000 --out big.pickle   # a large one (bench)

Outputs: ``resnet50_native.pickle.gz`` (PyTorch's _dump_snapshot format, as PyTorch's own caching
allocator lays memory out: cudaMalloc-style segments, segment_alloc/segment_free) and
``resnet50_gpumem.json.gz`` (gpumem's snapshot format, gpumem's pool: pages mapped on demand).
"""
from __future__ import annotations

import argparse
import gzip
import pickle
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from gpumem import _C
from gpumem.replay import TRACES_DIR
from gpumem.report.record import PoolRecorder, write_snapshot

GiB = 1 << 30
US_PER_OP = 25.0
TORCH = "/opt/conda/lib/python3.12/site-packages/torch"
VISION = "/opt/conda/lib/python3.12/site-packages/torchvision"
SCRIPT = "/home/user/train_resnet50.py"


def _py(name: str, filename: str, line: int) -> Dict[str, Any]:
    return {"name": name, "filename": filename, "line": line}


_ALLOC_CPP = [_py("c10::cuda::CUDACachingAllocator::Native::DeviceCachingAllocator::malloc(...)",
                  "c10/cuda/CUDACachingAllocator.cpp", 1343),
              _py("at::detail::empty_generic(...)", "aten/src/ATen/EmptyTensor.cpp", 193),
              _py("at::native::empty_cuda(...)", "aten/src/ATen/native/cuda/EmptyTensor.cpp", 52)]
_STEP = [_py("train_step", SCRIPT, 41), _py("<module>", SCRIPT, 63)]
_BLOCK = [_py("_call_impl", f"{TORCH}/nn/modules/module.py", 1784),
          _py("forward", f"{VISION}/models/resnet.py", 146), _py("_call_impl", f"{TORCH}/nn/modules/module.py", 1784),
          _py("_forward_impl", f"{VISION}/models/resnet.py", 275), _py("forward", f"{VISION}/models/resnet.py", 285),
          _py("_call_impl", f"{TORCH}/nn/modules/module.py", 1784)]
STACKS = {
    "parameters": _ALLOC_CPP + [_py("at::native::_to_copy(...)", "aten/src/ATen/native/TensorConversions.cpp", 296),
                                _py("convert", f"{TORCH}/nn/modules/module.py", 1355),
                                _py("_apply", f"{TORCH}/nn/modules/module.py", 942),
                                _py("to", f"{TORCH}/nn/modules/module.py", 1369), _py("<module>", SCRIPT, 30)],
    "gradients": _ALLOC_CPP + [_py("torch::autograd::AccumulateGrad::apply(...)",
                                   "torch/csrc/autograd/functions/accumulate_grad.cpp", 82),
                               _py("_engine_run_backward", f"{TORCH}/autograd/graph.py", 829),
                               _py("backward", f"{TORCH}/autograd/__init__.py", 347),
                               _py("backward", f"{TORCH}/_tensor.py", 648), _py("train_step", SCRIPT, 44),
                               _py("<module>", SCRIPT, 63)],
    "optimizer state": _ALLOC_CPP + [_py("at::native::zeros_like(...)", "aten/src/ATen/native/TensorFactories.cpp", 1260),
                                     _py("_init_group", f"{TORCH}/optim/adam.py", 168),
                                     _py("step", f"{TORCH}/optim/adam.py", 231),
                                     _py("wrapper", f"{TORCH}/optim/optimizer.py", 485),
                                     _py("train_step", SCRIPT, 45), _py("<module>", SCRIPT, 63)],
    "conv": _ALLOC_CPP + [_py("at::native::cudnn_convolution(...)", "aten/src/ATen/native/cudnn/ConvShared.cpp", 415),
                          _py("_conv_forward", f"{TORCH}/nn/modules/conv.py", 549),
                          _py("forward", f"{TORCH}/nn/modules/conv.py", 554)] + _BLOCK + _STEP,
    "batch_norm": _ALLOC_CPP + [_py("at::native::batch_norm_cuda(...)", "aten/src/ATen/native/cuda/Normalization.cu", 490),
                                _py("batch_norm", f"{TORCH}/nn/functional.py", 2817),
                                _py("forward", f"{TORCH}/nn/modules/batchnorm.py", 193)] + _BLOCK + _STEP,
    "relu": _ALLOC_CPP + [_py("relu", f"{TORCH}/nn/functional.py", 1704),
                          _py("forward", f"{TORCH}/nn/modules/activation.py", 144)] + _BLOCK + _STEP,
    "backward": _ALLOC_CPP + [_py("at::native::cudnn_convolution_backward_weight(...)",
                                  "aten/src/ATen/native/cudnn/ConvShared.cpp", 602),
                              _py("_engine_run_backward", f"{TORCH}/autograd/graph.py", 829),
                              _py("backward", f"{TORCH}/autograd/__init__.py", 347),
                              _py("backward", f"{TORCH}/_tensor.py", 648), _py("train_step", SCRIPT, 44),
                              _py("<module>", SCRIPT, 63)],
    "empty_cache": [_py("empty_cache", f"{TORCH}/cuda/memory.py", 222), _py("<module>", SCRIPT, 58)],
    "bigger batch": _ALLOC_CPP + [_py("at::native::randn(...)", "aten/src/ATen/native/TensorFactories.cpp", 1021),
                                  _py("train_step", SCRIPT, 38), _py("<module>", SCRIPT, 70)],
}
_FORWARD = ("conv", "batch_norm", "relu", "conv")


def read_trace(path: Path) -> List[Tuple[str, int, int]]:
    """('a', id, bytes) / ('f', id, 0) operations of a bundled trace."""
    ops = []
    with gzip.open(path, "rt") as f:
        for line in f:
            p = line.split()
            if not p or p[0] == "#":
                continue
            ops.append((p[0], int(p[1]), int(p[2]) if p[0] == "a" else 0))
    return ops


def classify(ops: List[Tuple[str, int, int]]) -> Dict[int, str]:
    """A stack name per allocation id, from its lifetime in the whole trace."""
    first_free = next(i for i, op in enumerate(ops) if op[0] == "f")
    teardown = len(ops) - 400  # the trace ends by freeing the model and its state
    born: Dict[int, int] = {}
    died: Dict[int, int] = {}
    for i, (kind, ident, _) in enumerate(ops):
        (born if kind == "a" else died)[ident] = i
    seen_sizes: Dict[int, int] = {}
    sizes = {ident: size for kind, ident, size in ops if kind == "a"}
    out = {}
    for ident, b in born.items():
        d = died.get(ident, len(ops))
        if d >= teardown:  # lives for the whole run
            if b < first_free:
                out[ident] = "parameters"
            else:
                n = seen_sizes[sizes[ident]] = seen_sizes.get(sizes[ident], 0) + 1
                out[ident] = "gradients" if n == 1 else "optimizer state"
        elif d - b < 40:
            out[ident] = "backward"
        else:
            out[ident] = _FORWARD[(sizes[ident] >> 9) % len(_FORWARD)]
    return out


def record(upstream: str, events: Optional[int] = None, trace: str = "resnet50") -> PoolRecorder:
    """Replay the trace through a pool on a simulated 8 GiB device, recording what it does.

    Without ``events``: up to the peak of the 3rd iteration, with an empty_cache after the 1st and
    an OOM at the end. With ``events``: the trace over and over (ids renamed per pass) until the
    recorder holds that many events, then the same OOM."""
    ops = read_trace(TRACES_DIR / f"{trace}.trace.gz")
    kinds = classify(ops)
    clock = [0.0]
    pool = _C.Pool(_C.SimulatedDevice(upstream, 8 * GiB))
    rec = PoolRecorder(pool, source=f"{trace}.trace.gz replayed through gpumem's pool ({upstream}); stacks "
                                    f"and times synthesized (tools/make_report_examples.py)",
                       clock=lambda: clock[0])
    if events is None:
        live = peak = 0
        sizes: Dict[int, int] = {}
        stop = 0
        for i, (kind, ident, size) in enumerate(ops[:6000]):
            if kind == "a":
                sizes[ident] = size
                live += size
            else:
                live -= sizes.pop(ident)
            if i >= 5000 and live > peak:
                peak, stop = live, i + 1
        passes, empty_at = [ops[:stop]], 2500
    else:
        passes, empty_at = [], -1
        while sum(len(p) for p in passes) * 1.02 < events:
            passes.append(ops)
    ptr: Dict[Tuple[int, int], int] = {}
    for n, part in enumerate(passes):
        for i, (kind, ident, size) in enumerate(part):
            clock[0] += US_PER_OP
            if i == empty_at:
                rec.trim(STACKS["empty_cache"])
            if kind == "a":
                ptr[n, ident] = rec.allocate(size, 0, STACKS[kinds[ident]])
            else:
                rec.free(ptr.pop((n, ident)))
            if events is not None and rec.events >= events - 10:
                break
        if events is not None and rec.events >= events - 10:
            break
        if events is not None:  # the blocks the trace never frees: freed before the next pass
            for key in [k for k in ptr if k[0] == n]:
                rec.free(ptr.pop(key))
    clock[0] += US_PER_OP
    try:
        rec.allocate(4 * GiB, 0, STACKS["bigger batch"])
    except _C.OutOfMemoryError:
        pass
    else:
        raise SystemExit("the 4 GiB allocation fit: the example needs an OOM; change the capacity")
    return rec


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--events", type=int, help="record this many events (the trace repeated) instead")
    ap.add_argument("--out", help="with --events: the file to write (.pickle[.gz]: PyTorch's format, "
                                  ".json[.gz]: gpumem's)")
    args = ap.parse_args(argv)
    here = Path(__file__).resolve().parents[1] / "python" / "gpumem" / "report" / "examples"
    if args.events:
        if not args.out:
            ap.error("--events needs --out")
        out = Path(args.out)
        rec = record("segments" if ".pickle" in out.name else "vmm", args.events)
        write(rec, out)
        print(f"{out}: {rec.events:,} events, {out.stat().st_size:,} bytes")
        return 0
    for upstream, name in (("segments", "resnet50_native.pickle.gz"), ("vmm", "resnet50_gpumem.json.gz")):
        rec = record(upstream)
        write(rec, here / name)
        print(f"{here / name}: {rec.events:,} events, {(here / name).stat().st_size:,} bytes")
    return 0


def write(rec: PoolRecorder, out: Path) -> None:
    if ".pickle" in out.name:
        data = pickle.dumps(rec.torch_snapshot(), protocol=4)
        out.write_bytes(gzip.compress(data, mtime=0) if out.name.endswith(".gz") else data)
    else:
        write_snapshot(rec.snapshot(), out)


if __name__ == "__main__":
    sys.exit(main())
