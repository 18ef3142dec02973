"""The public surface: every name in gpumem.__all__ resolves, the Config TypedDict has every key the
core returns, the allocator controls say why they cannot act without gpumem as torch's allocator, and
one OOM test (gpumem.is_oom_error) recognises every kind of out-of-memory error and nothing else."""
import subprocess
import sys

import pytest

import gpumem
from gpumem.config import Config


def test_every_public_name_resolves():
    for name in gpumem.__all__:
        assert getattr(gpumem, name) is not None, name
    assert gpumem.pool is gpumem.mem_pool  # the former name, an alias
    assert gpumem.Pool is gpumem._C.Pool and gpumem.OutOfMemoryError is gpumem._C.OutOfMemoryError


def test_config_typeddict_lists_every_key_parse_config_returns():
    parsed = gpumem.parse_config("cap:0.5,release:high_water,release_slack:0.01,page_size:16MiB")
    assert set(parsed) == set(Config.__annotations__)
    assert parsed["page_size"] == 16 << 20 and parsed["release_slack"] == 0.01


def test_allocator_controls_say_why_without_gpumem_as_torch_allocator():
    if gpumem.is_active():
        pytest.skip("gpumem is torch's allocator here: the GPU suite checks the controls")
    calls = [lambda: gpumem.trim(), lambda: gpumem.set_cap(1 << 30), lambda: gpumem.cap(0),
             lambda: gpumem.validate("cuda:0"), lambda: gpumem.driver_time()]
    for call, name in zip(calls, ("trim", "set_cap", "cap", "validate", "driver_time")):
        with pytest.raises(RuntimeError) as ei:
            call()
        assert f"gpumem.{name}()" in str(ei.value) and gpumem.status_line() in str(ei.value)


def test_set_cap_rejects_what_is_not_a_byte_count():
    with pytest.raises(TypeError):
        gpumem.set_cap(0.5)
    with pytest.raises(TypeError):
        gpumem.set_cap(True)
    with pytest.raises(ValueError):
        gpumem.set_cap(-1)


def test_allocator_controls_without_torch():
    code = ("import sys; sys.modules['torch'] = None\nimport gpumem\n"
            "try:\n    gpumem.trim()\nexcept RuntimeError as e:\n    print('ERR', e)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "ERR gpumem.trim()" in r.stdout and "not importable" in r.stdout


def core_oom():
    pool = gpumem.Pool(gpumem.SimulatedDevice("vmm", capacity=64 << 20))
    try:
        pool.allocate(1 << 30)
    except gpumem.OutOfMemoryError as e:
        return e
    raise AssertionError("no OOM")


def test_is_oom_error_recognises_every_kind():
    torch = pytest.importorskip("torch")
    oom = gpumem.is_oom_error
    assert oom(core_oom())                                                   # direct Pool use
    assert oom(torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert oom(torch.cuda.OutOfMemoryError("x"))                             # the type, whatever it says
    assert oom(RuntimeError("CUDA out of memory. Tried to allocate 2 GiB"))
    assert oom(RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate"))
    assert oom(RuntimeError("cuDNN error: CUDNN_STATUS_ALLOC_FAILED"))
    assert oom(RuntimeError("CUDA error: out of memory"))
    assert oom(MemoryError("GPU out of memory"))
    try:
        try:
            raise torch.cuda.OutOfMemoryError("inner")
        except Exception as e:
            raise ValueError("wrapped") from e
    except ValueError as e:
        assert oom(e)                                                        # raised from an OOM
        assert gpumem._errors.find_oom_error(e) is e.__cause__
    try:
        try:
            raise RuntimeError("CUBLAS_STATUS_ALLOC_FAILED")
        except RuntimeError:
            raise KeyError("while handling it")  # noqa: B904
    except KeyError as e:
        assert oom(e)                                                        # raised while handling one
    assert not oom(None)
    assert not oom(MemoryError())                                            # host memory
    assert not oom(ValueError("CUDA out of memory"))                         # the type decides first
    assert not oom(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not oom(RuntimeError("out of memory"))                            # names no GPU


def test_the_extension_and_the_finder_use_the_one_test():
    pytest.importorskip("torch")
    from gpumem import batch_size, ipython_ext

    assert ipython_ext.is_oom is gpumem.is_oom_error
    assert batch_size._is_oom(core_oom()) and not batch_size._is_oom(ValueError("x"))
