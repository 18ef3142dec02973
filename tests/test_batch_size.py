"""CPU tests of gpumem.find_batch_size: the search against simulated memory curves, the
state-restoring guarantee with the real step runner on a CPU model (memory simulated),
argument validation, and the distributed agreement with two gloo processes."""
import math
import os
import random
import socket

import pytest
import sim_memory  # tests/sim_memory.py
import torch
import torch.nn as nn

from gpumem import batch_size as bs

BatchSizeError, BatchSizeResult, Trial = bs.BatchSizeError, bs.BatchSizeResult, bs.Trial
_search, find_batch_size = bs._search, bs.find_batch_size

MiB = 1 << 20
GiB = 1 << 30


# ----------------------------------------------------------------------------- simulated curves


class Curve:
    """measure(b): peak bytes of a simulated step; raises OOM above ``limit``."""

    def __init__(self, fn, limit, oom_kind="torch"):
        self.fn, self.limit, self.calls, self.oom_kind = fn, limit, [], oom_kind

    def __call__(self, b):
        self.calls.append(b)
        peak = self.fn(b)
        if peak > self.limit:
            if self.oom_kind == "cublas":
                raise RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`")
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {peak - self.limit} bytes")
        return peak


def true_max(fn, target, hi=1 << 16):
    b = 0
    while b + 1 <= hi and fn(b + 1) <= target:
        b += 1
    return b


def check(fn, target, limit=None, hi=1 << 16, max_trials=None, **kw):
    m = Curve(fn, target if limit is None else limit, **kw)
    out = _search(m, target, 1, hi)
    expect = true_max(fn, target, hi)
    # the largest size to within the default resolution (0.5 %: exact below 200)
    assert expect - int(0.005 * expect) <= out.batch_size <= expect, (out.batch_size, expect, m.calls)
    # the returned size passed a real trial
    assert any(t.batch_size == out.batch_size and t.fits for t in out.trials)
    if max_trials is not None:
        assert len(out.trials) <= max_trials, m.calls
    return out, m


def test_linear_curve_exact_and_few_trials():
    target = 35 * GiB
    fn = lambda b: 3 * GiB + b * int(0.85 * GiB)  # noqa: E731  (the GPT's shape: 37 fits)
    out, m = check(fn, target, max_trials=6)
    assert out.batch_size == 37
    assert abs(out.bytes_per_sample - int(0.85 * GiB)) < MiB
    assert abs(out.fixed_bytes - 3 * GiB) < 4 * MiB
    assert out.predicted_peak_bytes == fn(37)
    assert out.measured_peak_bytes == fn(37)
    # only the probes are small; no more than one trial fails
    assert sum(not t.fits for t in out.trials) <= 1


@pytest.mark.parametrize("per_sample", [1, 1000, 12345, 3 * MiB, 700 * MiB])
def test_linear_curves_many_slopes(per_sample):
    target = 20 * GiB
    check(lambda b: 512 * MiB + b * per_sample, target, hi=1 << 20, max_trials=14)


def test_fixed_overhead_dominates():
    target = 10 * GiB
    out, _ = check(lambda b: int(0.8 * target) + b * 37 * MiB, target, max_trials=7)
    assert out.batch_size == 55


def test_jump_in_the_curve():
    target = 16 * GiB
    fn = lambda b: GiB + b * 100 * MiB + (7 * GiB if b >= 90 else 0)  # noqa: E731  (an algorithm switch)
    out, m = check(fn, target, max_trials=16)
    assert out.batch_size == 89


def test_convex_curve():
    target = 16 * GiB
    check(lambda b: GiB + b * 50 * MiB + b * b * 2 * MiB, target, max_trials=10)


def test_step_curve_rounding():
    # memory that grows in 256 MiB steps (segment rounding)
    target = 8 * GiB
    check(lambda b: GiB + 256 * MiB * math.ceil(b * 30 * MiB / (256 * MiB)), target, max_trials=10)


def test_noisy_curve():
    target = 32 * GiB
    rng = random.Random(7)
    noise = {}

    def fn(b):  # +-1.5 % of the target, fixed per batch size
        if b not in noise:
            noise[b] = int(rng.uniform(-0.015, 0.015) * target)
        return 2 * GiB + b * 300 * MiB + noise[b]

    m = Curve(fn, target)
    out = _search(m, target, 1, 1 << 16)
    clean = true_max(lambda b: 2 * GiB + b * 300 * MiB, target)
    best = out.batch_size
    assert any(t.batch_size == best and t.fits for t in out.trials)
    assert fn(best) <= target
    assert abs(best - clean) <= 3, (best, clean, m.calls)
    assert len(out.trials) <= 12


def test_resolution_near_a_limit_the_line_overshoots():
    # large batches whose memory bends up near the limit (workspaces, fragmentation): the line
    # from small probes over-predicts; the default search stops within 0.5% of the true max
    # with few trials, resolution=0 finds it exactly with more
    target = 34 * GiB

    def fn(b):
        return GiB + b * (3 * MiB + 600 * 1024) + max(0, b - 8000) ** 2 * 16 * 1024

    expect = true_max(fn, target)
    coarse = Curve(fn, target)
    out = _search(coarse, target, 1, 1 << 16)
    assert expect * 0.995 <= out.batch_size <= expect
    assert any(t.batch_size == out.batch_size and t.fits for t in out.trials)
    # the one above the bracket's top failed: the result is within the resolution, proven
    failed_above = [t.batch_size for t in out.trials if not t.fits and t.batch_size > out.batch_size]
    assert min(failed_above) - out.batch_size <= max(1, int(0.005 * out.batch_size))
    exact = Curve(fn, target)
    out0 = _search(exact, target, 1, 1 << 16, resolution=0.0)
    assert out0.batch_size == expect
    assert len(out.trials) < len(out0.trials), (coarse.calls, exact.calls)


@pytest.mark.parametrize("overhead", [0.003, 0.006, 0.01, 0.02, 0.15])
@pytest.mark.parametrize("fixed,per_sample", [(0.24, 6.6), (0.11, 1.758), (0.2, 1.1)])
def test_overhead_near_the_limit_costs_few_trials(fixed, per_sample, overhead):
    # The GPU's picture (bert, gen and seqlen of bench/batch_size_bench.py): the allocated peaks lie on
    # a line, but near the limit the allocator's pages need 0.3-2 % of the target on top of them (the
    # gap between the largest fitting trial's peak and the target), and the reserved peaks of probes far
    # from the limit are 25 % above the allocated ones (cached blocks the pool gives back under
    # pressure); a small budget sees 15 % (GPU test of mode="generate"). The search must find the limit
    # to its resolution with few trials near it.
    target = int(3.14 * GiB)

    def allocated(b):
        return int(fixed * GiB) + b * int(per_sample * MiB)

    calls = []

    def measure(b):
        calls.append(b)
        if allocated(b) > target * (1 - overhead):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB")
        return bs.results._Measurement(allocated(b), int(1.25 * allocated(b)), None)

    out = _search(measure, target, 1, 1 << 16, resolution=0.0025)
    expect = true_max(lambda b: allocated(b) / (1 - overhead), target)
    assert expect - int(0.0025 * expect) <= out.batch_size <= expect, (out.batch_size, expect, calls)
    assert any(t.batch_size == out.batch_size and t.fits for t in out.trials)
    near = [t for t in out.trials if t.phase != "probe"]
    # each failure doubles the allowance (1, 2, 4, 8, 16 %) until a fit, then bisection
    assert len(near) <= (5 if overhead <= 0.02 else 11), calls


def test_oom_by_exception_and_by_message():
    target = 8 * GiB
    fn = lambda b: GiB + b * 64 * MiB  # noqa: E731
    for kind in ("torch", "cublas"):
        # the device limit (6 GiB) is lower than the target: every failure arrives as an exception
        # (torch's OOM type, or cuBLAS's message), never as a peak over the target
        m = Curve(fn, 6 * GiB, oom_kind=kind)
        out = _search(m, target, 1, 1 << 16)
        assert out.batch_size == true_max(fn, 6 * GiB) == 80, (kind, m.calls)
        assert any(t.batch_size == 80 and t.fits for t in out.trials)
        ooms = [t for t in out.trials if t.outcome == "oom"]
        assert ooms and all(t.batch_size > 80 for t in ooms), (kind, out.trials)
        assert not any(t.outcome == "over" for t in out.trials)


def test_nothing_fits():
    target = 4 * GiB
    m = Curve(lambda b: 5 * GiB + b, 4 * GiB)
    with pytest.raises(BatchSizeError) as ei:
        _search(m, target, 1, 100)
    assert "batch size 1 does not fit" in str(ei.value)
    assert "4.00 GiB" in str(ei.value)  # the memory available
    assert m.calls == [1]
    # a peak over the target (no exception) names the memory needed
    m2 = Curve(lambda b: 5 * GiB + b, 100 * GiB)
    with pytest.raises(BatchSizeError, match=r"needs 5\.00 GiB.*4\.00 GiB is available"):
        _search(m2, target, 1, 100)


def test_no_line_to_aim_with_bisects():
    # The peak does not grow with the size up to 30,000 (every probe measures the same bytes), then
    # by 64 MiB a sample: the probes' growth by 4x runs out of memory at 32,768 with no line through
    # the sizes that fitted. The search bisects from there instead of walking down one size at a time
    # (32,767, 32,766, ...: it gave up after 40 trials that way).
    target = 8 * GiB
    out, m = check(lambda b: 750 * MiB + max(0, b - 30000) * 64 * MiB, target, max_trials=30)
    assert 30000 < out.batch_size < 32768


def test_everything_fits_up_to_the_bound():
    target = 80 * GiB
    out, m = check(lambda b: GiB + b * MiB, target, hi=64, max_trials=5)
    assert out.batch_size == 64 and out.at_upper_bound
    # flat curve (no slope visible at all)
    out, m = check(lambda b: GiB, target, hi=1000, max_trials=8)
    assert out.batch_size == 1000


def test_only_the_minimum_fits():
    target = 4 * GiB
    out, _ = check(lambda b: 3 * GiB + b * 600 * MiB, target)
    assert out.batch_size == 1


def test_non_oom_error_propagates_at_once():
    calls = []

    def measure(b):
        calls.append(b)
        if b > 1:
            raise ValueError("shape mismatch")
        return GiB

    with pytest.raises(ValueError, match="shape mismatch"):
        _search(measure, 8 * GiB, 1, 100)
    assert calls == [1, 2]


def test_min_batch_respected():
    target = 16 * GiB
    m = Curve(lambda b: GiB + b * 100 * MiB, target)
    out = _search(m, target, 8, 1 << 16)
    assert out.batch_size == true_max(m.fn, target) and min(m.calls) == 8


def test_plan():
    assert bs._plan(37, 20) == (20, 1)
    assert bs._plan(37, 100) == (25, 4)  # 100 = 4 x 25 (3 x 34 would not divide)
    assert bs._plan(37, 74) == (37, 2)
    mb, steps = bs._plan(37, 97)  # prime: balanced micro-batches
    assert mb <= 37 and mb * steps >= 97 and steps == 3


# ----------------------------------------------------------------------------- the real runner on a CPU model


def SimBackend(curve, limit, total=None, live=0):
    """tests/sim_memory.py's device, as the finder's first version saw it: no reserved peak."""
    return sim_memory.SimBackend(curve, limit, total=total, live=live, reports_reserved=False)


def small_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 5))


def snapshot(model, opt):
    params = {k: v.detach().clone() for k, v in model.state_dict(keep_vars=True).items()}
    grads = {n: (None if p.grad is None else p.grad.clone()) for n, p in model.named_parameters()}
    ostate = {}
    for i, (p, st) in enumerate(opt.state.items()):
        ostate[i] = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in st.items()}
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    flags = [m.training for m in model.modules()]
    return params, grads, ostate, groups, flags, torch.get_rng_state()


def bit_equal(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8) if a.dim() else a, b.view(torch.uint8) if b.dim() else b)


def assert_same(s1, s2):
    p1, g1, o1, gr1, f1, r1 = s1
    p2, g2, o2, gr2, f2, r2 = s2
    assert p1.keys() == p2.keys()
    for k in p1:
        assert bit_equal(p1[k], p2[k]), k
    for k in g1:
        assert (g1[k] is None) == (g2[k] is None), k
        if g1[k] is not None:
            assert bit_equal(g1[k], g2[k]), k
    assert o1.keys() == o2.keys()
    for i in o1:
        assert o1[i].keys() == o2[i].keys()
        for k in o1[i]:
            if torch.is_tensor(o1[i][k]):
                assert bit_equal(o1[i][k], o2[i][k]), (i, k)
            else:
                assert o1[i][k] == o2[i][k]
    assert gr1 == gr2
    assert f1 == f2
    assert torch.equal(r1, r2)


def used_model():
    """A model with optimizer state, accumulated gradients and BatchNorm statistics."""
    model = small_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    x = torch.randn(16, 8)
    for _ in range(2):
        model(x).pow(2).mean().backward()
        opt.step()
    model(x).sum().backward()  # leave gradients behind
    model.eval()  # and a non-default flag
    return model, opt


def run_find(model, backend, **kw):
    kw.setdefault("shape", (8,))
    kw.setdefault("verbose", False)
    args = dict(mode="train", dtype=torch.float32, input_range=None, input_fn=None, step_fn=None,
                loss_fn=None, optimizer=None, autocast=None, max_memory=None, margin=0.0, resolution=0.005,
                min_batch=2,
                max_batch=None, steps=3, target_batch=None, log=None, distributed=None)
    args.update(kw)
    shape = args.pop("shape")
    return bs._find(model, shape, backend=backend, **args)


def test_state_restored_bit_identical_with_user_optimizer():
    model, opt = used_model()
    before = snapshot(model, opt)
    backend = SimBackend(lambda b: 100 * MiB + b * MiB, limit=200 * MiB)
    res = run_find(model, backend, optimizer=opt)
    assert res.batch_size == 100
    assert len(backend.begun) >= 3  # real steps really ran (and changed the state)
    assert_same(before, snapshot(model, opt))


def test_state_restored_with_fresh_optimizer_and_oom_mid_step():
    model, opt = used_model()
    before = snapshot(model, opt)
    forwards = {"n": 0}

    def hook(mod, inp, out):  # an OOM in the forward of the second step, after one optimizer step
        forwards["n"] += 1
        if inp[0].shape[0] > 40 and forwards["n"] % 3 == 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 MiB.")

    h = model[4].register_forward_hook(hook)
    try:
        backend = SimBackend(lambda b: 100 * MiB + b * MiB, limit=200 * MiB)
        res = run_find(model, backend)  # default: a fresh AdamW per trial
    finally:
        h.remove()
    assert res.batch_size == 40
    assert any(t.outcome == "oom" for t in res.trials)
    assert_same(before, snapshot(model, opt))


def test_state_restored_when_step_raises():
    model, opt = used_model()
    before = snapshot(model, opt)
    backend = SimBackend(lambda b: 100 * MiB + b * MiB, limit=200 * MiB)
    with pytest.raises(RuntimeError) as ei:  # shape does not match Linear(8, ...)
        run_find(model, backend, shape=(7,), optimizer=opt)
    assert "does the input" in "".join(getattr(ei.value, "__notes__", []))
    assert "(batch, 7)" in "".join(getattr(ei.value, "__notes__", []))
    assert backend.begun == [2]  # re-raised at the first trial, not taken as OOM
    assert_same(before, snapshot(model, opt))


def test_step_fn_non_oom_error_reraised_at_once():
    calls = []

    def step(b):
        calls.append(b)
        raise KeyError("boom")

    backend = SimBackend(lambda b: MiB * b, limit=GiB)
    with pytest.raises(KeyError, match="boom"):
        run_find(None, backend, shape=None, step_fn=step)
    assert calls == [2]


def test_step_fn_oom_message_fallback():
    def step(b):
        if b > 12:
            raise RuntimeError("cuDNN error: CUDNN_STATUS_ALLOC_FAILED")

    backend = SimBackend(lambda b: MiB, limit=GiB)
    res = run_find(None, backend, shape=None, step_fn=step, steps=1, max_batch=1000)
    assert res.batch_size == 12


def test_inference_mode_and_input_options():
    model = nn.Sequential(nn.Embedding(50, 16), nn.Flatten(), nn.Linear(16 * 6, 3))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    backend = SimBackend(lambda b: 10 * MiB + b * 2 * MiB, limit=100 * MiB)
    res = run_find(model, backend, shape=(6,), dtype=torch.long, input_range=(0, 50), mode="inference")
    assert res.batch_size == 45
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])
    # input_fn returning a tuple is passed as positional arguments
    seen = []

    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 2)

        def forward(self, a, b):
            seen.append((a.shape[0], b.shape[0]))
            return self.lin(a + b)

    res = run_find(Two(), SimBackend(lambda b: b * MiB, limit=64 * MiB), shape=None,
                   input_fn=lambda n: (torch.randn(n, 4), torch.randn(n, 4)))
    assert res.batch_size == 64 and all(x == y for x, y in seen)


def test_result_plan_progress_and_summary():
    lines = []
    model = small_model()
    backend = SimBackend(lambda b: 100 * MiB + b * MiB, limit=200 * MiB, total=1000 * MiB)
    res = run_find(model, backend, target_batch=250, verbose=True, log=lines.append, margin=0.02)
    assert isinstance(res, BatchSizeResult) and all(isinstance(t, Trial) for t in res.trials)
    assert res.target_bytes == int(200 * MiB * 0.98)
    assert res.batch_size == 96
    assert (res.micro_batch_size, res.accumulation_steps) == (84, 3) or res.effective_batch >= 250
    assert res.micro_batch_size <= res.batch_size
    assert len(lines) == len(res.trials) + 2  # header, a line per trial, summary
    assert lines[-1] == res.summary() == str(res)
    assert "batch 96" in lines[-1] and "micro-batch" in lines[-1]
    assert int(res) == 96
    # quiet
    lines.clear()
    run_find(small_model(), SimBackend(lambda b: 100 * MiB + b * MiB, limit=200 * MiB), verbose=False,
             log=lines.append)
    assert lines == []


def test_budget_from_max_memory():
    backend = SimBackend(lambda b: 100 * MiB + b * MiB, limit=400 * MiB, total=1000 * MiB)
    res = run_find(small_model(), backend, max_memory=0.2)  # 200 MiB of the 1000 MiB device
    assert res.batch_size == 100 and res.budget_bytes == 200 * MiB
    res = run_find(small_model(), backend, max_memory=150 * MiB)
    assert res.batch_size == 50
    with pytest.raises(ValueError, match="larger than the device"):
        run_find(small_model(), backend, max_memory=2000 * MiB)


def test_batch_one_too_big_names_memory():
    backend = SimBackend(lambda b: 300 * MiB + b * MiB, limit=200 * MiB)
    with pytest.raises(BatchSizeError, match=r"batch size 2 does not fit.*200\.00 MiB|GiB"):
        run_find(small_model(), backend)
    backend = SimBackend(lambda b: b, limit=200 * MiB, live=250 * MiB)
    with pytest.raises(BatchSizeError, match="already use"):
        run_find(small_model(), backend)


# ----------------------------------------------------------------------------- argument validation


@pytest.mark.parametrize("kw, exc, msg", [
    (dict(mode="eval"), ValueError, "mode"),
    (dict(max_memory=0.0), ValueError, r"\(0, 1\]"),
    (dict(max_memory=1.5), ValueError, r"\(0, 1\]"),
    (dict(max_memory=-5), ValueError, "positive"),
    (dict(max_memory=True), TypeError, "max_memory"),
    (dict(max_memory="1GB"), TypeError, "max_memory"),
    (dict(margin=0.7), ValueError, "margin"),
    (dict(margin=-0.1), ValueError, "margin"),
    (dict(resolution=0.5), ValueError, "resolution"),
    (dict(resolution="fine"), ValueError, "resolution"),
    (dict(min_batch=0), ValueError, "min_batch"),
    (dict(min_batch=8, max_batch=4), ValueError, "max_batch"),
    (dict(steps=0), ValueError, "steps"),
    (dict(target_batch=0), ValueError, "target_batch"),
    (dict(optimizer=3), TypeError, "optimizer"),
    (dict(shape=(0, 3)), ValueError, "shape"),
    (dict(shape="abc"), ValueError, "shape"),
    (dict(shape=None), ValueError, "shape"),
    (dict(input_range=(5, 1)), ValueError, "input_range"),
    (dict(step_fn=5), TypeError, "step_fn"),
])
def test_argument_validation(kw, exc, msg):
    kw.setdefault("shape", (8,))
    shape = kw.pop("shape")
    with pytest.raises(exc, match=msg):
        find_batch_size(small_model(), shape, **kw)


def test_model_required_without_step_fn():
    with pytest.raises(ValueError, match="model"):
        find_batch_size(None, (3,))
    with pytest.raises(TypeError, match="nn.Module"):
        find_batch_size("resnet", (3,))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_no_gpu_clear_error():
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        find_batch_size(small_model(), (8,))


def test_model_on_cpu_error():
    with pytest.raises(ValueError, match=r"model\.cuda\(\)"):
        bs._model_device(small_model())


def test_oom_classification():
    assert bs._is_oom(torch.OutOfMemoryError("x"))
    assert bs._is_oom(RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate"))
    assert bs._is_oom(RuntimeError("cuDNN error: CUDNN_STATUS_ALLOC_FAILED"))
    assert not bs._is_oom(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not bs._is_oom(ValueError("CUDA out of memory"))  # only RuntimeErrors by message
    assert bs._requested_bytes("CUDA out of memory. Tried to allocate 2.50 GiB. GPU 0") == int(2.5 * GiB)
    assert bs._requested_bytes("Tried to allocate 20.00 MiB") == 20 * MiB
    assert bs._requested_bytes("nothing") == 0


# ----------------------------------------------------------------------------- distributed (gloo, 2 processes)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _dist_worker(rank, world, port, scenario, results):
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        kw = {}
        if scenario == "uneven":
            # Rank r has a budget of 2000 MiB / (r + 1) and the same step; the verification's first
            # run of the answer runs out of memory on the last rank (a size that passed the search
            # does not fit every time near the cap), so every rank must step down alike.
            limit = 2000 * MiB // (rank + 1)
            backend = sim_memory.SimBackend(lambda b: 100 * MiB + b * 10 * MiB, limit=limit,
                                            oom_request="64.00 MiB")
            spiked = []

            def spike(b, n):
                # the first trial to run a size a second time (the verification): out of memory on the
                # last rank (n: the trials begun so far; a trial asks for its peak more than once)
                if rank == 1 and not spiked and backend.begun.count(b) == 2:
                    spiked.append(n)
                return 500 * MiB if spiked and spiked[0] == n else 0

            backend.jitter = spike
            kw = dict(verify_steps=2, margin=None, max_memory=limit)
        else:
            per_sample = [10 * MiB, 13 * MiB][rank]  # rank 1 runs out of memory first
            backend = SimBackend(lambda b: 100 * MiB + b * per_sample, limit=1000 * MiB)

        def step(b):
            if scenario == "error" and rank == 1 and b > 8:
                raise ValueError("rank 1 broke")

        try:
            res = run_find(None, backend, shape=None, step_fn=step, steps=1, **kw)
            results[rank] = ("ok", res.batch_size, res.world_size)
        except Exception as e:  # noqa: BLE001
            results[rank] = ("error", type(e).__name__, str(e))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("scenario", ["oom", "error", "uneven"])
def test_distributed_agreement_gloo(scenario):
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    with ctx.Manager() as mgr:
        results = mgr.dict()
        port = _free_port()
        procs = [ctx.Process(target=_dist_worker, args=(r, 2, port, scenario, results)) for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(90)
        hung = [p for p in procs if p.is_alive()]
        for p in hung:
            p.kill()
        assert not hung, "a rank hung"
        res = dict(results)
    if scenario == "oom":
        expect = (1000 * MiB - 100 * MiB) // (13 * MiB)  # the minimum over the ranks
        assert res[0] == ("ok", expect, 2) and res[1] == ("ok", expect, 2), res
    elif scenario == "uneven":
        # One answer on both ranks, below what the last rank's search proved (its verification ran
        # out of memory), and inside its budget: the ranks stepped down alike, each from the budget
        # the common target came from (the larger rank's own budget stepped it below size 1).
        assert res[0][0] == "ok" and res[0] == res[1], res
        assert 2 <= res[1][1] < (1000 * MiB - 100 * MiB) // (10 * MiB), res
    else:
        assert res[1][:2] == ("error", "ValueError"), res
        assert res[0][:2] == ("error", "RuntimeError") and "another rank" in res[0][2], res
