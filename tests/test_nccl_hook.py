"""gpumem turns ProcessGroupNCCL's register hook off on CUDA virtual memory (gpumem/_nccl_hook.py);
the GPU half (collectives on two ranks with the hook asked for) is tests/gpu/test_distributed_gpu.py."""
import os
import warnings

import pytest

from gpumem import _nccl_hook

VAR = _nccl_hook.HOOK_VARIABLE


@pytest.mark.parametrize("value", ["1", "true", "YES", "y", "T"])
@pytest.mark.parametrize("config", [None, {"upstream": "auto"}, {"upstream": "vmm"}])
def test_the_hook_asked_for_is_turned_off_on_pages_with_a_warning(monkeypatch, value, config):
    monkeypatch.setenv(VAR, value)
    with pytest.warns(RuntimeWarning, match=f"{VAR}={value} turned off") as caught:
        assert _nccl_hook.turn_off_for_pages(config) is True
    assert "upstream:segments" in str(caught[0].message)
    assert os.environ[VAR] == "0" and not _nccl_hook.hook_requested()


# Off as ProcessGroupNCCL reads it, or values it refuses itself ("Invalid value for environment
# variable"): its own error stays, not hidden behind a 0.
@pytest.mark.parametrize("value", [None, "0", "false", "No", "f", "", "on", " 1", "2"])
def test_a_hook_not_asked_for_is_left_alone(monkeypatch, value):
    if value is None:
        monkeypatch.delenv(VAR, raising=False)
    else:
        monkeypatch.setenv(VAR, value)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _nccl_hook.turn_off_for_pages({"upstream": "auto"}) is False
    assert os.environ.get(VAR) == value


def test_whole_segments_keep_the_hook(monkeypatch):
    monkeypatch.setenv(VAR, "1")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _nccl_hook.turn_off_for_pages({"upstream": "segments"}) is False
    assert os.environ[VAR] == "1" and _nccl_hook.hook_requested()


def test_the_configuration_gpumem_parses_names_its_upstream():
    # turn_off_for_pages reads the key parse_config gives (a rename there would keep the hook on).
    from gpumem.config import parse_config

    assert dict(parse_config(""))["upstream"] == "auto"
    assert dict(parse_config("upstream:segments"))["upstream"] == "segments"
