"""The OOM-in-a-cell scenario: run notebooks/oom_recovery.ipynb once per mode, each in a fresh kernel.

    python tests/gpu/oom_scenario.py [--modes abc] [--out DIR] [--timeout 300]

Modes (``GPUMEM_NB_MODE``): a = ``torch.cuda.empty_cache()`` alone, b = ``gpumem.cleanup()``,
c = nothing, with ``%load_ext gpumem``.  Prints a table of ``memory_allocated`` / ``memory_reserved``
in the cell after the OOM next to what the live variables hold, checks the targets for b and c
(allocated within 1 MiB of the baseline - the model plus the cuBLAS workspace - and reserved within
one segment of it) and exits nonzero when they are missed.  Executed notebooks are saved to ``--out``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Dict, List, Optional

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK = ROOT / "notebooks" / "oom_recovery.ipynb"
MiB = 1 << 20
ALLOC_TOL = 1 * MiB
# one segment: PyTorch's native allocator's largest standard segment is 20 MiB (kLargeBuffer);
# override for a pool with other segment sizes
SEGMENT = int(os.environ.get("GPUMEM_SEGMENT_BYTES", 20 * MiB))
LABELS = {"a": "torch.cuda.empty_cache()", "b": "gpumem.cleanup()", "c": "nothing (%load_ext gpumem)"}


def kernel_env() -> Dict[str, str]:
    """Environment for the kernels: make ``import gpumem`` work from the checkout when not installed."""
    env = dict(os.environ)
    py = str(ROOT / "python")
    try:
        import gpumem  # noqa: F401
        installed = Path(gpumem.__file__).resolve().parents[1] != Path(py)
    except Exception:
        installed = False
    if not installed:
        env["PYTHONPATH"] = py + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def execute(nb_path: Path, out_path: Optional[Path], env_extra: Dict[str, str], timeout: int = 600):
    """Execute a notebook in a fresh kernel; returns the executed notebook."""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(str(nb_path), as_version=4)
    saved = dict(os.environ)
    env = {**kernel_env(), **env_extra}  # computed before os.environ is cleared below
    os.environ.clear()
    os.environ.update(env)
    try:
        client = NotebookClient(nb, timeout=timeout, kernel_name="python3",
                                resources={"metadata": {"path": str(nb_path.parent)}})
        client.execute()
    finally:
        os.environ.clear()
        os.environ.update(saved)
        if out_path is not None:
            out_path.parent.mkdir(parents=True, exist_ok=True)
            nbformat.write(nb, str(out_path))
    return nb


def outputs_text(nb) -> str:
    parts: List[str] = []
    for c in nb.cells:
        for o in c.get("outputs", []):
            if o.get("output_type") == "stream":
                parts.append(o.get("text", ""))
            elif "data" in o and "text/plain" in o["data"]:
                parts.append(o["data"]["text/plain"])
            elif o.get("output_type") == "error":
                parts.append(o.get("ename", "") + ": " + o.get("evalue", ""))
    return "\n".join(parts)


def run_mode(mode: str, out_dir: Optional[Path], timeout: int = 600) -> dict:
    out = (out_dir / f"oom_recovery_{mode}.ipynb") if out_dir else None
    nb = execute(NOTEBOOK, out, {"GPUMEM_NB_MODE": mode}, timeout=timeout)
    text = outputs_text(nb)
    line = next((l for l in text.splitlines() if l.startswith("GPUMEM_RESULT ")), None)
    if line is None:
        raise RuntimeError(f"mode {mode}: no GPUMEM_RESULT line in the notebook output:\n{text[-3000:]}")
    res = json.loads(line[len("GPUMEM_RESULT "):])
    res["oom_seen"] = "OutOfMemoryError" in text or "out of memory" in text
    return res


def check(res: dict) -> List[str]:
    """Target failures for modes b and c (mode a is the 'today' reference and has no target)."""
    if res["mode"] == "a":
        return []
    fails = []
    if not res.get("oom_seen"):
        fails.append("the OOM cell did not run out of memory")
    ref = res["baseline"]
    if abs(res["allocated"] - ref) > ALLOC_TOL:
        fails.append(f"allocated {res['allocated'] / MiB:.1f} MiB not within 1 MiB of baseline {ref / MiB:.1f} MiB")
    if res["reserved"] - res["allocated"] > SEGMENT:
        fails.append(f"reserved {res['reserved'] / MiB:.1f} MiB more than one segment ({SEGMENT / MiB:.0f} MiB) "
                     f"above allocated {res['allocated'] / MiB:.1f} MiB")
    return fails


def table(results: List[dict]) -> str:
    L = [f"{'mode':<4} {'recovery (next cell)':<28} {'allocated MiB':>14} {'reserved MiB':>13} "
         f"{'live vars MiB':>14} {'baseline MiB':>13}  target"]
    for r in results:
        f = check(r)
        verdict = "-" if r["mode"] == "a" else ("PASS" if not f else "FAIL: " + "; ".join(f))
        L.append(f"{r['mode']:<4} {LABELS.get(r['mode'], '?'):<28} {r['allocated'] / MiB:>14.1f} "
                 f"{r['reserved'] / MiB:>13.1f} {r['live'] / MiB:>14.1f} {r['baseline'] / MiB:>13.1f}  {verdict}")
    L.append("live vars = the model's parameters; baseline = allocated after building the model and one warm-up "
             "forward (live vars + cuBLAS workspace).")
    return "\n".join(L)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", default="abc")
    ap.add_argument("--out", default=os.environ.get("GPUMEM_NB_OUT", str(ROOT / "notebooks" / "executed")))
    ap.add_argument("--timeout", type=int, default=600)
    args = ap.parse_args(argv)
    out_dir = Path(args.out) if args.out else None
    results = []
    for m in args.modes:
        try:
            results.append(run_mode(m, out_dir, timeout=args.timeout))
        except Exception as e:
            print(f"mode {m}: FAILED to run: {type(e).__name__}: {e}", file=sys.stderr)
            return 2
    print(table(results))
    if out_dir:
        (out_dir / "oom_scenario.json").write_text(json.dumps(results, indent=1))
    return 1 if any(check(r) for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
