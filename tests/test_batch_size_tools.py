"""CPU tests of the batch-size tools around the search: the measured margin and the final
verification, progress lines and the notebook table, the length search and the token frontier,
generate mode (a real tiny GPT-2 from transformers, when installed), and the OOM-retry decorator
(real ``torch.cuda.OutOfMemoryError`` instances; compared with Accelerate's decorator when installed).
Memory is simulated by a backend (as in tests/test_batch_size.py); the steps are real."""
import gc
import weakref

import pytest
import torch
import torch.nn as nn
from sim_memory import SimBackend  # tests/sim_memory.py

import gpumem
from gpumem import batch_size as bs
from gpumem.batch_size import lengths as lengths_mod
from gpumem.batch_size import verify as verify_mod

MiB = 1 << 20
GiB = 1 << 30


ARGS = dict(mode="train", dtype=None, input_range=None, input_fn=None, step_fn=None, loss_fn=None, optimizer=None,
            autocast=None, max_memory=None, margin=None, resolution=None, min_batch=1, max_batch=None, steps=1,
            target_batch=None, log=None, distributed=None, verbose=False, verify_steps=2)


def run_find(model, backend, shape=(8,), **kw):
    args = dict(ARGS)
    args.update(kw)
    return bs._find(model, shape, backend=backend, **args)


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


# ----------------------------------------------------------------------------- measured margin, verification


def true_max(fn, limit):
    b = 0
    while fn(b + 1) <= limit:
        b += 1
    return b


def test_measured_margin_reaches_98_percent_and_stays_below_the_max():
    limit = 20 * GiB
    fn = lambda b: 3 * GiB + b * 40 * MiB  # noqa: E731
    backend = SimBackend(fn, limit)
    res = run_find(mlp(), backend, max_batch=100000)
    best = true_max(fn, limit)
    assert 0.98 * best <= res.batch_size <= best, (res.batch_size, best)
    assert res.target_bytes == limit - verify_mod.floor_bytes(limit)
    assert res.verified_steps == 2 and res.spread_bytes == 0
    verify_trials = [t for t in res.trials if t.phase == "verify"]
    assert len(verify_trials) == 1 and verify_trials[0].batch_size == res.batch_size and verify_trials[0].fits
    assert res.margin_bytes == limit - fn(res.batch_size)


def test_the_backend_sets_the_smallest_floor_of_a_small_budget():
    # 3 GiB, as the GPU test's per-process budget: 0.4 % is 12 MiB, so the allocator's smallest floor
    # decides (32 MiB for PyTorch's caching allocator, one page, 8 MiB, for gpumem's pool)
    limit = 3 * GiB
    fn = lambda b: 160 * MiB + b * 31 * MiB  # noqa: E731

    class PagedBackend(SimBackend):
        def floor_min_bytes(self):
            return 8 * MiB

    native = run_find(mlp(), SimBackend(fn, limit), max_batch=1000)
    paged = run_find(mlp(), PagedBackend(fn, limit), max_batch=1000)
    assert native.target_bytes == limit - 32 * MiB
    assert paged.target_bytes == limit - int(0.004 * limit)  # 12.3 MiB: the fraction, above the page
    assert native.batch_size == true_max(fn, native.target_bytes) == 92
    assert paged.batch_size == true_max(fn, paged.target_bytes) == 93


def test_the_cuda_backends_smallest_floor_follows_the_allocator(monkeypatch):
    # which allocator is torch's, and with which configuration, is only known with CUDA (the bridge
    # keeps GPUMEM_CONF as it read it); the choice the backend makes from it is here
    from gpumem import _torch
    from gpumem.batch_size.backend import _CudaBackend
    from gpumem.config import parse_config

    backend = _CudaBackend(torch.device("cuda", 0))  # nothing touches the device
    assert _torch.active_config() is None  # no bridge on this machine
    assert backend.floor_min_bytes() == 32 * MiB  # PyTorch's allocator
    for conf, floor in [("", 8 * MiB),  # gpumem's default page
                        ("page_size:32MiB", 32 * MiB),
                        ("page_size:2MiB,upstream:vmm", 2 * MiB),
                        ("upstream:segments", 32 * MiB)]:  # whole segments: PyTorch's floor
        monkeypatch.setattr(_torch, "active_config", lambda conf=conf: dict(parse_config(conf)))
        monkeypatch.setenv("GPUMEM_CONF", "page_size:4MiB")  # set after the start: not the pool's
        assert backend.floor_min_bytes() == floor, conf


def test_fixed_margin_still_accepted():
    limit = 20 * GiB
    fn = lambda b: 3 * GiB + b * 40 * MiB  # noqa: E731
    res = run_find(mlp(), SimBackend(fn, limit), margin=0.02, verify_steps=0, max_batch=100000)
    assert res.target_bytes == int(limit) - int(limit * 0.02)
    assert res.batch_size == true_max(fn, res.target_bytes) or res.batch_size >= 0.995 * true_max(fn, res.target_bytes)
    assert res.verified_steps == 0 and not any(t.phase == "verify" for t in res.trials)


def test_run_to_run_spread_steps_the_answer_down():
    # a size peaks 300 MiB higher when it runs again (the verification reruns the answer): the answer
    # must keep the spread the verification measures free below the budget, so it steps down
    limit = 20 * GiB
    fn = lambda b: 3 * GiB + b * 40 * MiB  # noqa: E731
    runs = {}  # size -> the trials (numbered by the backend) that ran it

    def jitter(b, call):
        runs.setdefault(b, set()).add(call)
        return 300 * MiB if len(runs[b]) > 1 else 0

    res = run_find(mlp(), SimBackend(fn, limit, jitter=jitter), max_batch=100000)
    steady = run_find(mlp(), SimBackend(fn, limit), max_batch=100000)
    assert res.spread_bytes > 0 and res.batch_size < steady.batch_size
    assert fn(res.batch_size) + res.spread_bytes <= limit  # the measured spread is kept free
    assert [t.phase for t in res.trials].count("verify") >= 2  # the rerun failed, a smaller size verified


def test_verify_pure():
    trials = []
    proven = bs.Trial(100, "fits", 900, 950, 0.1, "prove")
    # the same peak again: nothing moves
    v = verify_mod.verify(lambda b: bs.results._Measurement(900, 950), 100, proven, budget=1100, target=1000,
                          bytes_per_sample=9, lo=1, log=trials.append)
    assert (v.batch_size, v.spread_bytes) == (100, 0) and len(trials) == 1 and trials[0].phase == "verify"
    # an OOM at the proven size steps down and verifies the smaller one

    def flaky(b):
        if b == 100:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB.")
        return bs.results._Measurement(9 * b, 9 * b)

    v = verify_mod.verify(flaky, 100, proven, budget=1100, target=1000, bytes_per_sample=9, lo=1)
    assert v.batch_size < 100 and [t.outcome for t in v.trials] == ["oom", "fits"]
    # under a cap at the target the reserved peak sits at the cap whatever the size: an OOM at the
    # proven size (needing 60 bytes more than its proof, more than half the floor) steps down, and the allocated peaks decide
    # (on the GPU, counting the capped reserved peak instead gave up after 4 rounds)
    oom_once = [True]

    def capped(b):
        if b == 100 and oom_once.pop():
            raise bs.results._TrialOOM(100, 960, None)
        return bs.results._Measurement(9 * b, 1000)

    v = verify_mod.verify(capped, 100, proven, budget=1100, target=1000, bytes_per_sample=9, lo=1, capped=True)
    assert [t.outcome for t in v.trials] == ["oom", "fits"] and v.spread_bytes == 60
    assert 9 * v.batch_size + v.spread_bytes <= 1100 - 50
    with pytest.raises(bs.BatchSizeError, match="could not be verified"):  # the same, counting reserved
        oom_once.append(True)
        verify_mod.verify(capped, 100, proven, budget=1100, target=1000, bytes_per_sample=9, lo=1)
    # failures that say nothing of the need (needed = the proof's peak) step down by the floor's worth
    # of samples, doubled each time: 100 -> 88 -> 65 -> 20 (fits) where a fixed step (88, 77, 66, ...)
    # would still fail at the fourth round
    def fails_above_60(b):
        if b > 60:
            raise bs.results._TrialOOM(b, 900, None)
        return bs.results._Measurement(9 * b, 9 * b)

    v = verify_mod.verify(fails_above_60, 100, proven, budget=1100, target=1000, bytes_per_sample=9, lo=1)
    assert [t.batch_size for t in v.trials] == [100, 88, 65, 20] and v.batch_size == 20
    # a non-OOM error propagates
    with pytest.raises(KeyError):
        verify_mod.verify(lambda b: (_ for _ in ()).throw(KeyError("x")), 100, proven, budget=1100, target=1000,
                          bytes_per_sample=9, lo=1)


# ----------------------------------------------------------------------------- progress, table


def test_progress_lines_and_tables():
    lines = []
    res = run_find(mlp(), SimBackend(lambda b: 100 * MiB + b * MiB, 2 * GiB), verbose=True, log=lines.append,
                   max_batch=100000)
    trial_lines = lines[1:-1]  # a header, a line per trial, the summary
    assert len(trial_lines) == len(res.trials)
    for t, line in zip(res.trials, trial_lines):
        assert f"batch {t.batch_size:>7d}" in line and "measured" in line and " s" in line
        assert ("fits" in line) == t.fits
    assert any(t.predicted_bytes is not None for t in res.trials)
    assert lines[-1] == res.summary() and "verified with 2 steps" in lines[-1]
    text = repr(res)
    assert text.splitlines()[0] == res.summary() and len(text.splitlines()) == len(res.trials) + 2
    html = res._repr_html_()
    assert html.count("<tr>") == len(res.trials) + 1 and "<table>" in html
    quiet = []
    run_find(mlp(), SimBackend(lambda b: 100 * MiB + b * MiB, 2 * GiB), verbose=False, log=quiet.append)
    assert quiet == []


# ----------------------------------------------------------------------------- sequence length


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(50, 8)
        self.head = nn.Linear(8, 50)
        self.seen = []

    def forward(self, ids):
        self.seen.append(tuple(ids.shape))
        return self.head(self.emb(ids))


def test_max_length_search():
    model = TinyLM()
    batch = 3
    fn = lambda n: 200 * MiB + batch * (n * MiB + n * n * 512)  # noqa: E731  (attention: quadratic)
    backend = SimBackend(fn, 4 * GiB)
    res = run_find(model, backend, shape=(8192,), dtype=torch.long, input_range=(0, 50), min_batch=1,
                   max_batch=8192, searched="length", dim=0, length_batch=batch)
    best = true_max(fn, 4 * GiB)
    assert 0.98 * best <= res.size <= best and res.searched == "length" and res.dim == 0
    assert all(s[0] == batch for s in model.seen)  # the batch stays fixed, the length varies
    assert {s[1] for s in model.seen} == {t.batch_size for t in res.trials if t.outcome != "oom"} | {
        t.batch_size for t in res.trials if t.outcome == "oom"}
    assert "length" in res.summary() and "find_max_length" in res.summary()


def test_token_frontier(monkeypatch):
    limit = 8 * GiB
    cost = lambda b, n: 500 * MiB + b * (n * 256 * 1024 + n * n * 64)  # noqa: E731

    def fake_on_cuda(model, shape, **kw):  # find_max_length's path, with memory simulated
        batch = kw.pop("length_batch")
        kw.pop("name")
        return bs._find(model, shape, backend=SimBackend(lambda n: cost(batch, n), limit), length_batch=batch,
                        **kw)

    def fake_find_batch_size(model, shape, **kw):
        args = dict(ARGS)
        args.update(kw)
        return bs._find(model, shape, backend=SimBackend(lambda b: cost(b, shape[0]), limit), **args)

    monkeypatch.setattr(lengths_mod, "_on_cuda", fake_on_cuda)
    monkeypatch.setattr(lengths_mod, "find_batch_size", fake_find_batch_size)
    front = gpumem.find_token_frontier(TinyLM(), (100000,), dtype=torch.long, input_range=(0, 50), points=3,
                                       verbose=False, steps=1, verify_steps=1)
    assert len(front.points) == 3
    longest = front.points[0][0]
    assert longest == front.max_length.size and cost(1, longest) <= limit
    for n, b, t in front.points:
        assert t == n * b and cost(b, n) <= limit and cost(b + 1, n) > limit - verify_mod.floor_bytes(limit)
    assert front.max_tokens_per_step == min(t for _, _, t in front.points)
    assert front.batch_for(front.points[-1][0]) == front.points[-1][1]
    assert front.batch_for(longest + 1) == 0
    assert "max tokens per step" in front.summary() and "<table>" in front._repr_html_()


@pytest.mark.parametrize("kw, exc, msg", [
    (dict(dim=2), ValueError, "dim"),
    (dict(batch_size=0), ValueError, "batch_size"),
    (dict(min_length=0), ValueError, "min_length"),
    (dict(target_batch=8), TypeError, "target_batch"),
    (dict(step_fn=print), TypeError, "step_fn"),
])
def test_find_max_length_argument_checks(kw, exc, msg):
    with pytest.raises(exc, match=msg):
        gpumem.find_max_length(TinyLM(), (128,), **kw)


# ----------------------------------------------------------------------------- generate mode


def tiny_gpt2():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=64, n_embd=16, n_layer=2, n_head=2)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg).eval()


def test_generate_mode_runs_the_whole_generation():
    model = tiny_gpt2()
    lengths = []
    h = model.register_forward_pre_hook(lambda m, a, kw: lengths.append(kw["input_ids"].shape), with_kwargs=True)
    try:
        res = run_find(model, SimBackend(lambda b: 50 * MiB + b * 4 * MiB, GiB), shape=(5,), mode="generate",
                       max_new_tokens=7, input_range=(0, 64), max_batch=64)
    finally:
        h.remove()
    assert res.batch_size == 64  # everything fits up to the bound
    # every generation ran its 7 steps: the prompt, then 6 single-token steps with the KV cache
    generations = sum(2 if t.phase == "verify" else 1 for t in backend_trials(res))  # verify_steps=2
    assert len(lengths) == 7 * generations
    assert lengths[0][1] == 5 and all(s[1] == 1 for s in lengths[1:7])


def backend_trials(res):
    return [t for t in res.trials if t.outcome != "oom"]


def test_generate_mode_argument_checks():
    with pytest.raises(ValueError, match="max_new_tokens"):
        gpumem.find_batch_size(tiny_gpt2(), (5,), mode="generate")
    with pytest.raises(TypeError, match="generate"):
        gpumem.find_batch_size(mlp(), (5,), mode="generate", max_new_tokens=4)
    with pytest.raises(ValueError, match="max_new_tokens applies"):
        gpumem.find_batch_size(mlp(), (5,), max_new_tokens=4)
    with pytest.raises(ValueError, match="verify_steps"):
        gpumem.find_batch_size(mlp(), (5,), verify_steps=-1)


# ----------------------------------------------------------------------------- the decorator


def oom(b):
    return torch.cuda.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {b} MiB. GPU 0")


def test_decorator_retries_like_accelerate_without_a_gpu():
    limit_b = 37
    seen = []

    def train(batch_size, model, scale=1):
        seen.append(batch_size)
        if batch_size > limit_b:
            raise oom(batch_size)
        return batch_size * scale

    wrapped = gpumem.find_executable_batch_size(starting_batch_size=128, verbose=False)(train)
    assert wrapped("model", scale=2) == 2 * wrapped.batch_size
    assert seen[0] == 128 and seen[-1] <= limit_b
    accelerate = pytest.importorskip("accelerate.utils")
    theirs = []

    def train2(batch_size, model, scale=1):
        theirs.append(batch_size)
        if batch_size > limit_b:
            raise oom(batch_size)
        return batch_size * scale

    accelerate.find_executable_batch_size(starting_batch_size=128)(train2)("model", scale=2)
    assert seen == theirs  # without figures to predict from, the same 0.9x steps as Accelerate
    # the size reached persists: the next call starts there
    seen.clear()
    wrapped("model")
    assert seen == [theirs[-1]]


def test_decorator_never_retries_other_errors():
    calls = []

    @gpumem.find_executable_batch_size(starting_batch_size=64, verbose=False)
    def bad(batch_size):
        calls.append(batch_size)
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied (64x3 and 4x5)")

    with pytest.raises(RuntimeError, match="shapes"):
        bad()
    assert calls == [64]

    @gpumem.find_executable_batch_size(starting_batch_size=64, verbose=False)
    def bad2(batch_size):
        calls.append(batch_size)
        raise ValueError("CUDA out of memory")  # not an OOM: a ValueError's text proves nothing

    with pytest.raises(ValueError):
        bad2()
    assert calls == [64, 64]


def test_decorator_reaches_zero_and_guards_arguments():
    @gpumem.find_executable_batch_size(starting_batch_size=4, verbose=False)
    def never(batch_size):
        raise oom(batch_size)

    with pytest.raises(RuntimeError, match="No executable batch size found, reached zero."):
        never()

    @gpumem.find_executable_batch_size(starting_batch_size=4, verbose=False)
    def f(batch_size, a):
        return batch_size

    with pytest.raises(TypeError, match="Batch size was passed into `f` as the first argument"):
        f(8, 1)
    with pytest.raises(ValueError, match="starting_batch_size"):
        gpumem.find_executable_batch_size(f, starting_batch_size=-1)


def test_decorator_frees_what_the_failed_try_held():
    refs = []

    @gpumem.find_executable_batch_size(starting_batch_size=8, verbose=False)
    def train(batch_size):
        if refs:
            # the previous try's activations are gone before this try starts
            assert refs[-1]() is None, "the failed try's tensor is still alive"
            return batch_size
        activations = torch.empty(1 << 20)
        refs.append(weakref.ref(activations))
        try:
            raise oom(batch_size)
        except torch.cuda.OutOfMemoryError as e:
            err = e  # a reference cycle: the error -> its traceback -> this frame -> the error
            raise err

    gc.disable()  # the cycle must be broken by the decorator, not by a lucky automatic collection
    try:
        assert train() == 7
    finally:
        gc.enable()


def test_decorator_custom_reduction_probe_and_target_batch():
    seen = []

    @gpumem.find_executable_batch_size(starting_batch_size=100, reduce_batch_size_fn=lambda: seen[-1] // 2,
                                       verbose=False)
    def halve(batch_size):
        seen.append(batch_size)
        if batch_size > 30:
            raise oom(batch_size)
        return batch_size

    assert halve() == 25 and seen == [100, 50, 25]
    calls = []

    @gpumem.find_executable_batch_size(starting_batch_size=512, probe=lambda: 40, target_batch=100, verbose=False)
    def acc(batch_size, accumulation_steps):
        calls.append((batch_size, accumulation_steps))
        if batch_size > 30:
            raise oom(batch_size)
        return batch_size * accumulation_steps

    assert acc() >= 100
    assert calls[0] == bs._plan(40, 100)  # started at the probe's answer, as a plan for the target
    mb, steps = calls[-1]
    assert mb <= 30 and mb * steps >= 100 and acc.accumulation_steps == steps
    with pytest.raises(TypeError, match="accumulation_steps"):
        gpumem.find_executable_batch_size(lambda batch_size: 0, target_batch=8)


def test_decorator_progress_lines():
    lines = []

    @gpumem.find_executable_batch_size(starting_batch_size=10, log=lines.append)
    def f(batch_size):
        if batch_size > 8:
            raise oom(batch_size)
        return batch_size

    f()
    assert len(lines) == len(f.tries) == 3  # 10 and 9 fail, 8 fits
    assert "OOM" in lines[0] and "next 9" in lines[0] and "fits" in lines[2]
