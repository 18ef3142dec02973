"""Does the process keep the Python frames of a finished forward pass alive?

A forward pass with no autograd graph leaves nothing behind once it returns: its frames and the
activations they held are freed. Under compute-sanitizer with host backtraces on (its default,
--show-backtrace yes) they stay alive, held from outside Python (no Python object refers to them),
with PyTorch's own allocator as with gpumem's. tools/compute_sanitizer.sh therefore runs with
--show-backtrace device. This script shows it:

    python tools/sanitizer_frames_check.py native|gpumem                 # 0 frames, 0 tensors
    compute-sanitizer --tool memcheck python tools/sanitizer_frames_check.py native
    compute-sanitizer --tool memcheck --show-backtrace device python tools/sanitizer_frames_check.py native

Prints the frames and activation tensors still alive; exits 1 when any are.
"""
import gc
import sys
import types

allocator = sys.argv[1] if len(sys.argv) > 1 else "gpumem"
if allocator == "gpumem":
    import gpumem  # noqa: F401  registers gpumem's allocator before CUDA starts
elif allocator != "native":
    raise SystemExit("usage: sanitizer_frames_check.py native|gpumem")
import torch  # noqa: E402

D = 4096
model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(D, D), torch.nn.GELU()) for _ in range(2)]).cuda()
with torch.no_grad():
    model(torch.randn(8, D, device="cuda"))
torch.cuda.synchronize()
gc.collect()

frames = [f"{o.f_code.co_name} ({o.f_code.co_filename.rsplit('/', 1)[-1]}:{o.f_lineno})"
          for o in gc.get_objects() if isinstance(o, types.FrameType)]
activations = sum(1 for o in gc.get_objects() if torch.is_tensor(o) and o.is_cuda and tuple(o.shape) == (8, D))
print(f"{allocator}: {len(frames)} finished frames alive, {activations} activation tensors alive"
      + (": " + ", ".join(frames[:6]) + (" ..." if len(frames) > 6 else "") if frames else ""))
sys.exit(1 if frames or activations else 0)
