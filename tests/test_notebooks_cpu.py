"""notebooks/cpu_tour.ipynb runs without a GPU: executed here in a fresh kernel (nbclient + ipykernel),
on a copy, and its outputs must show the figures the notebook is about. The committed notebook keeps
its outputs (for reading on GitHub without running it): they must show the same figures.

To refresh the committed outputs after changing the notebook:

    python tests/test_notebooks_cpu.py        # executes notebooks/cpu_tour.ipynb in place
"""
from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "cpu_tour.ipynb"

# Deterministic on the simulated device: the same figures on every machine (the replay's ns/pair is
# not printed for that reason). The README's trace replay section shows the replay figures too.
EXPECTED = [
    "four blocks            allocated   803.0 MiB | reserved   810.0 MiB | device used   810.0 MiB",
    "validate(): ok",
    "90 MiB allocated       allocated   790.0 MiB | reserved   810.0 MiB",
    "leak check: device used == reserved",
    "gpumem: out of memory on device 0: tried to allocate 5.00 GiB",
    "did not allocate or has already freed; nothing was changed",
    "after trim()           allocated     0.0 MiB | reserved     0.0 MiB | device used     0.0 MiB",
    "gpt_varlen: 13,977 allocations, peak live 16.476 GiB, peak reserved 16.637 GiB, ratio 1.0098",
    "PyTorch on the H200: native 1.359, expandable segments 1.011, cudaMallocAsync 1.030",
    "resnet50: 9,177 allocations, peak live 5.641 GiB, peak reserved 5.662 GiB, ratio 1.0037",
    "PyTorch on the H200: native 1.120, expandable segments 1.007, cudaMallocAsync 1.008",
    "resnet50 on a 4 GiB device:",
    "$ python -m gpumem status   (exit 0)",
    "resnet50_native.pickle.gz -> resnet50_report.html:",
    "fragmentation 92%, OOMs 1",
    "It ran out of memory 1 time; the first time it asked for 4.00 GiB",
]
# What the last section says on a machine without a GPU (it shows the GPU on one).
EXPECTED_WITHOUT_GPU = [
    "gpumem is torch's allocator: False",
    "gpumem.trim(): gpumem.trim() acts on gpumem's pools as torch's CUDA allocator",
    "gpumem: no CUDA device available",
    "gpumem status: no GPU to show:",
]


def execute(path: Path, timeout: int = 600):
    """Execute the notebook at ``path`` in a fresh python3 kernel; returns the executed notebook."""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(str(path), as_version=4)
    saved = os.environ.pop("GPUMEM_CONF", None)  # the notebook shows gpumem's defaults
    try:
        NotebookClient(nb, timeout=timeout, kernel_name="python3", record_timing=False,
                       resources={"metadata": {"path": str(path.parent)}}).execute()
    finally:
        if saved is not None:
            os.environ["GPUMEM_CONF"] = saved
    return nb


def outputs(nb) -> tuple[str, list, int]:
    """(all text the cells printed or showed, the error outputs, how many PNG images)."""
    text, errors, pngs = [], [], 0
    for cell in nb.cells:
        for o in cell.get("outputs", []):
            if o.get("output_type") == "stream":
                text.append(o.get("text", ""))
            elif o.get("output_type") == "error":
                errors.append(f"{o.get('ename')}: {o.get('evalue')}")
            data = o.get("data", {})
            if "text/plain" in data:
                text.append(data["text/plain"])
            pngs += "image/png" in data
    return "\n".join(text), errors, pngs


def _no_gpu() -> bool:
    try:
        import torch

        return not torch.cuda.is_available()
    except Exception:
        return True


def check(nb, where: str) -> None:
    text, errors, pngs = outputs(nb)
    assert not errors, f"{where}: {errors}"
    for line in EXPECTED + (EXPECTED_WITHOUT_GPU if _no_gpu() else []):
        assert line in text, f"{where}: missing {line!r} in\n{text}"
    # the small device runs out of memory, and the first failure is the pool's own message
    m = re.search(r"resnet50 on a 4 GiB device: ([\d,]+) OOMs\nfirst: operation \d+: gpumem: out of memory",
                  text)
    assert m and int(m.group(1).replace(",", "")) > 0, f"{where}: no OOMs on the small device"
    assert pngs == 1, f"{where}: expected the replay's bar chart as one PNG, found {pngs}"


def test_cpu_tour_runs_without_a_gpu(tmp_path):
    pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    pytest.importorskip("matplotlib")
    copy = tmp_path / NOTEBOOK.name  # run a copy: the committed notebook stays as committed
    copy.write_bytes(NOTEBOOK.read_bytes())
    check(execute(copy), "executed now")


def test_committed_notebook_keeps_its_outputs():
    nbformat = pytest.importorskip("nbformat")
    nb = nbformat.read(str(NOTEBOOK), as_version=4)
    assert all(c.get("outputs") for c in nb.cells if c.cell_type == "code"), \
        "commit the notebook executed: python tests/test_notebooks_cpu.py"
    text, errors, pngs = outputs(nb)
    assert not errors and pngs == 1
    for line in EXPECTED:
        assert line in text, f"committed notebook: missing {line!r}"


if __name__ == "__main__":
    import nbformat

    executed = execute(NOTEBOOK)
    check(executed, str(NOTEBOOK))
    nbformat.write(executed, str(NOTEBOOK))
    print(f"{NOTEBOOK}: executed and saved", file=sys.stderr)
