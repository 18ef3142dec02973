"""NCCL collectives on memory of the chosen allocator, with ProcessGroupNCCL's allocator hooks on or off
(TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK, set by the caller), under torchrun, one GPU per rank.

    TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK=1 torchrun --standalone --nproc_per_node N \\
        tests/gpu/dist_nccl_register.py gpumem|native

Memory exists before the process group starts (NCCL registers it from the allocator's snapshot when
the hook is on); then, for three rounds, tensors of 1 KiB to 40 MiB (across several of gpumem's
pages) are all-reduced and all-gathered and the results checked exactly; between rounds everything
is freed and empty_cache() unmaps it, so the next round's tensors are new mappings, often at the same
addresses (a registration NCCL kept for the old memory would now be wrong). With gpumem, the tracker
audit (gpumem._bridge.tracker_audit) checks what trackers were told: every SEGMENT_FREE names a live
segment exactly, no SEGMENT_ALLOC overlaps one, no tracker raised, and the live segments are
torch.cuda.memory_snapshot()'s at the end.

gpumem turns the hook off when its pools map CUDA virtual memory pages (NCCL registers a segment as
one physical allocation; gpumem/_nccl_hook.py): ``hook`` is what the caller asked, ``hook_in_effect``
what ProcessGroupNCCL read. With ``GPUMEM_CONF=upstream:segments`` (whole cudaMalloc segments) the hook
stays on and NCCL registers gpumem's segments.

Prints ``RESULT {json}`` per rank.
"""
import os
import sys

ALLOCATOR = sys.argv[1] if len(sys.argv) > 1 else "gpumem"
HOOK_ASKED = os.environ.get("TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK", "0")
if ALLOCATOR == "gpumem":  # turns the hook off on CUDA virtual memory (gpumem/_nccl_hook.py)
    import gpumem
    from gpumem import _bridge

import _run  # noqa: E402  (tests/gpu, the script's own folder)
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

MiB = 1 << 20
SIZES = (256, 3 * MiB // 4, 10 * MiB // 4, 40 * MiB // 4)  # float32 elements: 1 KiB .. 40 MiB


def snapshot_segments():
    return sorted((s["device"], s["address"], s["total_size"]) for s in torch.cuda.memory_snapshot())


def main():
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    gpumem_on = ALLOCATOR == "gpumem"
    if gpumem_on:
        assert gpumem.is_active(), "gpumem is not torch's allocator"
        _bridge.start_tracker_audit()
    early = [torch.ones(n, device="cuda") for n in SIZES]  # segments that exist before NCCL starts
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    rank, world = dist.get_rank(), dist.get_world_size()
    checked = wrong = 0
    frees_seen = []
    for round_ in range(3):
        tensors = []
        for n in SIZES:
            pattern = torch.arange(n, device="cuda", dtype=torch.float32).remainder_(97)
            x = pattern * (rank + 1) + round_
            dist.all_reduce(x)
            expected = pattern * (world * (world + 1) // 2) + round_ * world
            wrong += int(not torch.equal(x, expected))
            out = torch.empty(world * n, device="cuda")
            mine = pattern + 1000 * rank + round_
            dist.all_gather_into_tensor(out, mine)
            want = torch.cat([pattern + 1000 * r + round_ for r in range(world)])
            wrong += int(not torch.equal(out, want))
            checked += 2
            tensors.append((x, out))
        torch.cuda.synchronize()
        del tensors, x, out, mine, pattern, expected, want
        early.clear()  # round 0's collectives ran while the early segments were still live
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # every page goes back: the next round maps memory anew
        if gpumem_on:
            frees_seen.append(_bridge.tracker_audit()["frees"])
    result = dict(rank=rank, world=world, allocator=ALLOCATOR,
                  hook=HOOK_ASKED, hook_in_effect=os.environ.get("TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK", "0"),
                  checked=checked, wrong=wrong, nccl=".".join(map(str, torch.cuda.nccl.version())))
    if gpumem_on:
        audit = _bridge.tracker_audit()
        result.update(allocs=audit["allocs"], frees=audit["frees"], frees_per_round=frees_seen,
                      mismatches=audit["mismatches"], tracker_errors=audit["tracker_errors"],
                      first_tracker_error=audit["first_tracker_error"],
                      audit_equals_snapshot=sorted(audit["segments"]) == snapshot_segments(),
                      live_segments=len(audit["segments"]))
    _run.print_result(result)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
