"""Which process model a colocated trainer and engine should use on one GPU, by measurement.

    python examples/one_gpu/process_model.py      (one GPU; writes $OUT/procmodel.json if OUT is set)

A "trainer" load (8192^3 bf16 matmuls) and an "engine" load (a decode-like step of 28 layers on
256 rows, replayed as a CUDA graph) run for 6 s each:
- alone;
- together in two processes (what layout.colocate does: two CUDA contexts time-slice the GPU);
- together in one process, on two CUDA streams from two threads (the alternative: the engine in
  the trainer's process).
Then a CUDA IPC copy: one process allocates 1.2 GB of bf16, another maps it through its IPC handle
and copies it into its own buffer (the colocated weight path). Prints one JSON object.
"""
import json, os, sys, time, threading
import torch
import torch.multiprocessing as mp

DUR = 6.0

def trainer_load(stream=None, stop=None, out=None):
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    with torch.cuda.stream(stream or torch.cuda.current_stream()):
        for _ in range(3): a @ b
        torch.cuda.synchronize()
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < DUR:
            for _ in range(10): c = a @ b
            torch.cuda.current_stream().synchronize()
            n += 10
        el = time.perf_counter() - t0
    r = {"load": "trainer", "tflops": n * 2 * 8192**3 / el / 1e12}
    if out is not None: out.append(r)
    return r

def engine_graph():
    """Capture the decode-like step once (before any concurrent work: a capture must be alone)."""
    x = torch.randn(256, 1024, device="cuda", dtype=torch.bfloat16)
    ws = [torch.randn(1024, 3072, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
    w2 = torch.randn(3072, 1024, device="cuda", dtype=torch.bfloat16)
    def step():
        h = x
        for _ in range(28):
            g = h @ ws[0]; u = h @ ws[1]
            h = (torch.nn.functional.silu(g) * u) @ w2 + h
            h = h * torch.rsqrt(h.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(h.dtype)
        return h
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        for _ in range(3): step()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        step()
    torch.cuda.synchronize()
    return g, (x, ws, w2)

def engine_replay(g, stream, out, barrier):
    barrier.wait()
    with torch.cuda.stream(stream):
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < DUR:
            g.replay(); stream.synchronize(); n += 1
        el = time.perf_counter() - t0
    out.append({"load": "engine", "step_ms": el / n * 1e3})

def trainer_threaded(stream, out, barrier):
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    barrier.wait()
    with torch.cuda.stream(stream):
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < DUR:
            for _ in range(10): a @ b
            stream.synchronize(); n += 10
        el = time.perf_counter() - t0
    out.append({"load": "trainer", "tflops": n * 2 * 8192**3 / el / 1e12})

def engine_load(stream=None, out=None, graph=True):
    # a decode-like step: 28 layers x (4 small matmuls + elementwise) on 256 rows, replayed as a CUDA graph
    x = torch.randn(256, 1024, device="cuda", dtype=torch.bfloat16)
    ws = [torch.randn(1024, 3072, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
    w2 = torch.randn(3072, 1024, device="cuda", dtype=torch.bfloat16)
    def step():
        h = x
        for _ in range(28):
            g = h @ ws[0]; u = h @ ws[1]
            h = (torch.nn.functional.silu(g) * u) @ w2 + h
            h = h * torch.rsqrt(h.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(h.dtype)
        return h
    s = stream or torch.cuda.Stream()
    with torch.cuda.stream(s):
        for _ in range(3): step()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            step()
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < DUR:
            g.replay(); torch.cuda.current_stream().synchronize(); n += 1
        el = time.perf_counter() - t0
    r = {"load": "engine", "step_ms": el / n * 1e3}
    if out is not None: out.append(r)
    return r

def proc(which, q, barrier):
    torch.cuda.set_device(0)
    barrier.wait()
    q.put(trainer_load() if which == "trainer" else engine_load())

def ipc_producer(q, done):
    torch.cuda.set_device(0)
    buf = torch.randn(600_000_000, device="cuda", dtype=torch.float32).to(torch.bfloat16)  # 1.2 GB
    torch.cuda.synchronize()
    st = buf.untyped_storage()
    handle = st._share_cuda_()
    q.put((handle, buf.numel(), float(buf[:1000].float().sum())))
    done.wait()

def ipc_consumer():
    ctx = mp.get_context("spawn")
    q, done = ctx.Queue(), ctx.Event()
    p = ctx.Process(target=ipc_producer, args=(q, done)); p.start()
    handle, numel, check = q.get()
    t0 = time.perf_counter()
    st = torch.UntypedStorage._new_shared_cuda(*handle)
    src = torch.empty(0, dtype=torch.bfloat16, device="cuda").set_(st, 0, (numel,), (1,))
    open_s = time.perf_counter() - t0
    dst = torch.empty_like(src)
    for _ in range(3): dst.copy_(src)
    torch.cuda.synchronize()
    times = []
    for _ in range(20):
        t0 = time.perf_counter(); dst.copy_(src); torch.cuda.synchronize(); times.append(time.perf_counter() - t0)
    ok = abs(float(dst[:1000].float().sum()) - check) < 1e-3
    done.set(); p.join()
    gb = numel * 2 / 1e9
    return {"load": "ipc_copy", "gb": gb, "open_ms": open_s * 1e3, "copy_ms_median": sorted(times)[10] * 1e3,
            "tb_per_s": gb / sorted(times)[10] / 1e3, "values_equal": ok}

if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    out = {"alone": [trainer_load(), engine_load()]}
    q, barrier = ctx.Queue(), ctx.Barrier(2)
    ps = [ctx.Process(target=proc, args=(w, q, barrier)) for w in ("trainer", "engine")]
    [p.start() for p in ps]; [p.join() for p in ps]
    out["two_processes"] = [q.get(), q.get()]
    res = []
    g, keep = engine_graph()
    bar = threading.Barrier(2)
    t1 = threading.Thread(target=trainer_threaded, args=(torch.cuda.Stream(), res, bar))
    t2 = threading.Thread(target=engine_replay, args=(g, torch.cuda.Stream(), res, bar))
    t1.start(); t2.start(); t1.join(); t2.join()
    out["one_process_two_streams"] = res
    out["ipc"] = ipc_consumer()
    print(json.dumps(out))
    os.makedirs(os.environ.get("OUT", "/tmp"), exist_ok=True)
    open(os.path.join(os.environ.get("OUT", "/tmp"), "procmodel.json"), "w").write(json.dumps(out, indent=1))
