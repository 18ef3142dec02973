import pytest


def pytest_collection_modifyitems(config, items):
    # GPU tests need a CUDA device; say so in the skip reason rather than failing on a CPU machine.
    try:
        import torch

        has_gpu = torch.cuda.is_available()
    except Exception:  # no torch, or a broken one: no GPU either way
        has_gpu = False
    if has_gpu:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the GPU machine with -m gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
