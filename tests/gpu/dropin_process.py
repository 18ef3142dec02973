"""Drop-in scenarios that need other processes or may kill this one (run by dropin_scenarios.py):
CUDA IPC through torch.multiprocessing (the spawned children import this module again, and with it
the same allocator), and the ``nocrash_*`` cases, each a torch call that must raise or succeed but
never end the process.
"""
from __future__ import annotations

import gc
import time

from dropin_common import (  # the allocator is chosen there, before torch starts
    MiB, DEV, FACTS, start, warm, exc_name, torch, try_gib, _capture_outputs, _captured,
)

# ----------------------------------------------------------------------------- CUDA IPC

IPC_N = 1000
IPC_SUM = float(IPC_N * (IPC_N - 1) // 2)
IPC_WAIT = 20.0  # seconds per case for the child's answer


def _ipc_child_args(t, results):
    try:
        results.put(("ok", float(t.sum().item())))
    except Exception as e:  # noqa: BLE001
        results.put(("error", f"{exc_name(e)}: {e}"))


def _ipc_child_queue(q, results):
    try:
        t = q.get(timeout=IPC_WAIT + 5)
        results.put(("ok", float(t.sum().item())))
        del t
    except Exception as e:  # noqa: BLE001
        results.put(("error", f"{exc_name(e)}: {e}"))


def _ipc_outcome(results, t0, feeder_errors=()):
    """Wait for the child's answer, or for a pickling error of the queue's feeder thread (the sender's
    error when sending through a Queue), and describe what happened."""
    deadline = t0 + IPC_WAIT
    while time.monotonic() < deadline:
        if feeder_errors:
            return dict(outcome="sender_error", seconds=round(time.monotonic() - t0, 2), message=feeder_errors[0])
        try:
            kind, value = results.get(timeout=0.2)
        except Exception:  # noqa: BLE001  queue.Empty
            continue
        if kind == "ok":
            return dict(outcome="received", value=value, seconds=round(time.monotonic() - t0, 2))
        return dict(outcome="child_error", message=value, seconds=round(time.monotonic() - t0, 2))
    return dict(outcome="hang", seconds=round(time.monotonic() - t0, 2))


def _stop(p):
    if p is not None and p.pid is not None:
        p.join(2)
        if p.is_alive():
            p.terminate()
            p.join(2)


def scenario_ipc():
    """A CUDA tensor sent to a spawned child, as a Process argument and through a Queue. Each case
    either arrives with the right values or fails on the sender's side; it must never hang."""
    import torch.multiprocessing as tmp

    start()
    ctx = tmp.get_context("spawn")
    t = torch.arange(IPC_N, dtype=torch.float32, device="cuda")
    torch.cuda.synchronize()
    result = {}

    # 1: the tensor as an argument of the child (pickled by Process.start())
    results = ctx.Queue()
    p = None
    t0 = time.monotonic()
    try:
        p = ctx.Process(target=_ipc_child_args, args=(t, results))
        p.start()
        result["process_args"] = _ipc_outcome(results, t0)
    except Exception as e:  # noqa: BLE001
        result["process_args"] = dict(outcome="sender_error", seconds=round(time.monotonic() - t0, 2),
                                      message=f"{exc_name(e)}: {e}")
    _stop(p)

    # 2: through a Queue: put() hands the tensor to a feeder thread, which pickles it; a pickling error
    # there never reaches put()'s caller, so the queue's error hook reports it here
    q, results = ctx.Queue(), ctx.Queue()
    feeder_errors: list = []
    q._on_queue_feeder_error = lambda e, obj: feeder_errors.append(f"{exc_name(e)}: {e}")
    p = ctx.Process(target=_ipc_child_queue, args=(q, results))
    p.start()
    t0 = time.monotonic()
    try:
        q.put(t)
        result["queue"] = _ipc_outcome(results, t0, feeder_errors)
    except Exception as e:  # noqa: BLE001
        result["queue"] = dict(outcome="sender_error", seconds=round(time.monotonic() - t0, 2),
                               message=f"{exc_name(e)}: {e}")
    _stop(p)
    FACTS["ipc"] = result
    torch.cuda.synchronize()


def _ipc_child_holds(q, results, orders):
    """Receives a tensor, answers its sum, drops it when told and says so, then stays alive until told
    to quit: the sender's memory must come back through its own collect, not through this exit."""
    try:
        t = q.get(timeout=IPC_WAIT + 5)
        results.put(("ok", float(t.sum().item())))
        orders.get(timeout=IPC_WAIT + 5)
        del t
        gc.collect()
        torch.cuda.synchronize()
        results.put(("ok", "released"))
        orders.get(timeout=IPC_WAIT + 5)
    except Exception as e:  # noqa: BLE001
        results.put(("error", f"{exc_name(e)}: {e}"))


def scenario_ipc_collect_on_oom():
    """A 1 GiB tensor sent to a child over CUDA IPC, dropped by the sender while the child still holds
    it, then by the child: torch keeps its block in the sender's "sent data limbo" until
    cuda_ipc_collect runs (torch's FreeCudaMemoryCallbacksRegistry). Under a fraction with room for
    one such tensor, the sender's next 1 GiB allocation fits only if the allocator runs those
    callbacks before it fails, as PyTorch's allocator does."""
    import torch.multiprocessing as tmp

    start()
    ctx = tmp.get_context("spawn")
    total = torch.cuda.get_device_properties(DEV).total_memory
    torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_reserved() + 1536 * MiB) / total)
    a = torch.full((256 * MiB,), 1.0, device="cuda")  # 1 GiB of float32
    torch.cuda.synchronize()
    q, results, orders = ctx.Queue(), ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_ipc_child_holds, args=(q, results, orders))
    p.start()
    fact: dict = {}
    try:
        q.put(a)
        fact["child_sum"] = _ipc_outcome(results, time.monotonic())
        if fact["child_sum"]["outcome"] == "received":
            del a
            gc.collect()
            orders.put("drop")
            fact["child_dropped"] = _ipc_outcome(results, time.monotonic())
            fact["next"], fact["num_ooms_delta"] = try_gib(2.0)
    finally:
        orders.put("quit")
        orders.put("quit")
        _stop(p)
    FACTS["ipc_collect"] = fact
    torch.cuda.set_per_process_memory_fraction(1.0)
    torch.cuda.synchronize()


# ----------------------------------------------------------------------------- calls that must not kill


def _try(name, call):
    try:
        r = call()
        FACTS[name] = dict(result="ok", value=repr(r)[:200])
    except Exception as e:  # noqa: BLE001  an exception is fine; dying is not
        FACTS[name] = dict(result=exc_name(e), message=str(e)[:500])


def _usable():
    try:
        t = torch.ones(MiB, device="cuda")
        FACTS["usable_after"] = float(t.sum().item()) == MiB
    except Exception as e:  # noqa: BLE001
        FACTS["usable_after"] = False
        FACTS["usable_after_error"] = f"{exc_name(e)}: {str(e)[:300]}"


def nocrash_fraction_zero_then_allocate():
    start()
    torch.cuda.set_per_process_memory_fraction(0.0)
    _try("allocate", lambda: torch.empty(MiB, device="cuda"))
    torch.cuda.set_per_process_memory_fraction(1.0)


def nocrash_fraction_nan_then_allocate():
    start()
    _try("set_nan", lambda: torch.cuda.set_per_process_memory_fraction(float("nan")))
    _try("get", lambda: torch.cuda.get_per_process_memory_fraction())
    _try("allocate", lambda: float(torch.ones(MiB, device="cuda").sum()))
    torch.cuda.set_per_process_memory_fraction(1.0)


def nocrash_delete_foreign_pointer():
    start()
    keep = torch.ones(MiB, device="cuda")
    _try("delete", lambda: torch.cuda.caching_allocator_delete(12345))
    assert float(keep.sum()) == MiB


def nocrash_delete_interior_pointer():
    start()
    t = torch.ones(MiB, device="cuda")
    _try("delete", lambda: torch.cuda.caching_allocator_delete(t.data_ptr() + 512))
    t.fill_(2.0)
    assert float(t.sum()) == 2 * MiB


def nocrash_double_delete():
    start()
    p = torch.cuda.caching_allocator_alloc(MiB)
    torch.cuda.caching_allocator_delete(p)
    _try("second_delete", lambda: torch.cuda.caching_allocator_delete(p))


def nocrash_alloc_zero():
    start()
    _try("alloc_zero", lambda: torch.cuda.memory.caching_allocator_alloc(0))
    if FACTS["alloc_zero"]["result"] == "ok":
        p = int(FACTS["alloc_zero"]["value"])
        _try("delete_zero", lambda: torch.cuda.caching_allocator_delete(p))


def nocrash_checkpoint_of_released_pool():
    start()
    x, g, outs, pool = _captured()
    state = torch._C._cuda_getCheckpointState(DEV, pool)
    del outs, g  # the pool goes away
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    g2, outs2 = _capture_outputs(x)  # another pool
    _try("restore", lambda: torch._C._cuda_setCheckpointPoolState(DEV, state, [], []))
    del outs2, g2


def nocrash_checkpoint_bad_state():
    start()
    _try("restore_none", lambda: torch._C._cuda_setCheckpointPoolState(DEV, None, [], []))
    _try("checkpoint_unknown_pool", lambda: torch._C._cuda_getCheckpointState(DEV, (987654, 321)))
    _try("live_unknown_pool", lambda: torch._C._cuda_checkPoolLiveAllocations(DEV, (987654, 321), set()))


def nocrash_history_unknown_skip_action():
    start()
    _try("record", lambda: torch.cuda.memory._record_memory_history(
        "all", context="all", stacks="python", skip_actions=["no_such_action"]))
    t = torch.ones(MiB, device="cuda")
    del t
    _try("snapshot", lambda: len(torch.cuda.memory._snapshot()["device_traces"]))
    _try("stop", lambda: torch.cuda.memory._record_memory_history(None))


def nocrash_empty_cache_during_capture():
    start()
    x = torch.arange(4096, dtype=torch.float32, device="cuda")
    warm(x)
    junk = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
    del junk  # something cached to release

    def capture():
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            y = x * 2
            torch.cuda.empty_cache()
            z = y + 1
        g.replay()
        torch.cuda.synchronize()
        return bool(torch.equal(z, x * 2 + 1))

    _try("capture", capture)


NOCRASH = {name[len("nocrash_"):]: fn for name, fn in list(globals().items()) if name.startswith("nocrash_")}
