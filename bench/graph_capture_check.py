"""CUDA graph capture through PyTorch (torch.cuda.graph, make_graphed_callables with backward,
torch.compile mode="reduce-overhead"), with PyTorch's allocator or gpumem's, to run under
compute-sanitizer and tell the tool's behaviour from the allocator's:

    compute-sanitizer --tool memcheck python bench/graph_capture_check.py native
    compute-sanitizer --tool memcheck python bench/graph_capture_check.py gpumem
"""
import sys

allocator = sys.argv[1] if len(sys.argv) > 1 else "gpumem"
if allocator == "gpumem":
    import gpumem  # noqa: F401  registers gpumem's allocator before CUDA starts
elif allocator != "native":
    raise SystemExit("usage: graph_capture_check.py native|gpumem")
import torch  # noqa: E402

dev = torch.device("cuda")
results = {}


def check(name, fn):
    try:
        fn()
        results[name] = "ok"
    except Exception as e:  # noqa: BLE001 - reported, the next check still runs
        results[name] = f"{type(e).__name__}: {str(e).splitlines()[0]}"
    print(f"{allocator}: {name}: {results[name]}", flush=True)


def graph():
    x = torch.arange(1024, device=dev, dtype=torch.float32)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        y = x * 2 + 1
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = x * 2 + 1
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, x * 2 + 1)


def graphed_callables():
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8)).cuda()
    inp = torch.randn(16, 64, device=dev, requires_grad=True)
    ref = model(inp).detach().clone()
    gm = torch.cuda.make_graphed_callables(model, (inp,))
    out = gm(inp)
    out.sum().backward()
    assert torch.allclose(out, ref, atol=1e-5)


def compiled():
    def f(a, b):
        return (a @ b).relu() + 1
    cf = torch.compile(f, mode="reduce-overhead")
    a = torch.randn(256, 256, device=dev)
    b = torch.randn(256, 256, device=dev)
    for _ in range(5):
        out = cf(a, b)
    assert torch.allclose(out, f(a, b), atol=1e-3)


check("torch.cuda.graph", graph)
check("make_graphed_callables", graphed_callables)
if "--no-compile" not in sys.argv:
    check("torch.compile(reduce-overhead)", compiled)
sys.exit(0 if all(v == "ok" for v in results.values()) else 1)
