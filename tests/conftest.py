import pytest


def pytest_collection_modifyitems(config, items):
    # GPU tests need a CUDA device; say so in the skip reason rather than failing on a CPU machine.
    try:
        import torch

        has_gpu = torch.cuda.is_available()
        gpus = torch.cuda.device_count() if has_gpu else 0
    except Exception:  # no torch, or a broken one: no GPU either way
        has_gpu, gpus = False, 0
    if gpus < 2:
        several = pytest.mark.skip(reason=f"needs 2 or more GPUs (one rank per GPU); this machine has {gpus}")
        for item in items:
            if "multigpu" in item.keywords:
                item.add_marker(several)
    if has_gpu:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the GPU machine with -m gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
