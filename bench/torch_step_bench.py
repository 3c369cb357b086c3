"""mainstay.torch against plain data-parallel AdamW on a ~100M-parameter GPT, in one run.

Starts mainstay-coordinator and two mainstayd on loopback (tests/testing/process_cluster.py),
then, for each mode, two gloo trainer ranks of the same GPT (client/python/examples/char_lm.py's
CharGPT) on the same random batches, and prints one table:

  adamw            the baseline: plain all-reduce of the gradients + torch.optim.AdamW (bf16
                   parameters: FP32 master copies and FP32 moments in the trainer, the usual
                   mixed-precision recipe)
  mainstay         MainstayOptimizer as shipped: overlap, the quantized parameter all-gather
  mainstay-fp32ag  MainstayOptimizer with allgather="fp32", overlap=False (the path before the
                   quantized all-gather and the hooks)

Columns: median step time (forward + backward + optimizer step, per rank, after --warmup
steps) and its ratio to adamw's; parameter all-gather bytes each rank sends per step; trainer
memory per parameter: peak RSS (ru_maxrss) and RSS after the last step, both minus the RSS
before the model was built, divided by the parameter count.

    PYTHONPATH=build/client/python /usr/bin/python3 bench/torch_step_bench.py [--build-dir build]

The binaries come from MAINSTAY_COORDINATOR_BIN / MAINSTAYD_BIN / MAINSTAYCTL_BIN, else from
--build-dir. --param-dtype fp32 is offered, but Debian's torch 1.13 runs FP32 matmuls on this
kind of machine about 100x slower than bf16 (31 s for one forward + backward of this model), so
the default is bf16.
"""
import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MODES = ("adamw", "mainstay", "mainstay-fp32ag")


def rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def worker(args):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    sys.path.insert(0, os.path.join(ROOT, "client", "python", "examples"))
    from char_lm import CharGPT
    from mainstay.torch import MainstayOptimizer

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="file://" + args.rdzv, rank=args.rank, world_size=args.world)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.param_dtype]
    base = rss_bytes()
    torch.manual_seed(0)
    model = CharGPT(args.vocab, args.dim, args.layers, args.heads, args.context).to(dtype)
    params = [p for p in model.parameters()]
    numel = sum(p.numel() for p in params)
    if args.mode == "adamw":
        masters = [p.detach().float().clone().requires_grad_() for p in params] if dtype != torch.float32 else params
        opt = torch.optim.AdamW(masters, lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)

        def step():
            for p, m in zip(params, masters):
                if m is not p:
                    m.grad = p.grad.float()
                dist.all_reduce(m.grad)
                m.grad /= args.world
            torch.nn.utils.clip_grad_norm_(masters, 1.0)
            opt.step()
            with torch.no_grad():
                for p, m in zip(params, masters):
                    if m is not p:
                        p.copy_(m)
                        m.grad = None
            for p in params:
                p.grad = None
        gathered = lambda: 0  # noqa: E731  (an all-reduce, no parameter all-gather)
    else:
        opt = MainstayOptimizer(model, args.coordinator, recipe=args.recipe, lr=1e-4, weight_decay=0.1,
                                betas=(0.9, 0.95), max_grad_norm=1.0, spec={"bucket_numel": args.bucket_numel},
                                allgather="fp32" if args.mode == "mainstay-fp32ag" else "quantized",
                                overlap=args.mode == "mainstay", timeout_s=600)

        def step():
            opt.step()
            opt.zero_grad()
        gathered = lambda: opt.allgather_bytes  # noqa: E731
    times = []
    for s in range(args.warmup + args.steps):
        g = torch.Generator().manual_seed(1000 * s + args.rank)
        x = torch.randint(0, args.vocab, (args.batch, args.context), generator=g)
        y = torch.randint(0, args.vocab, (args.batch, args.context), generator=g)
        t0 = time.perf_counter()
        F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten()).backward()
        step()
        times.append(time.perf_counter() - t0)
    result = {"mode": args.mode, "rank": args.rank, "params": numel, "step_s": statistics.median(times[args.warmup:]),
              "peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base,
              "end": rss_bytes() - base, "allgather_bytes": gathered()}
    results = [None] * args.world
    dist.all_gather_object(results, result)
    if args.rank == 0:
        print("RESULT " + json.dumps(results), flush=True)
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build-dir", default=os.path.join(ROOT, "build"))
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--recipe", default="bf16_with_fp8_current_scaling_mixed")
    ap.add_argument("--param-dtype", choices=["bf16", "fp32"], default="bf16")
    ap.add_argument("--dim", type=int, default=768)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--bucket-numel", type=int, default=4_000_000)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--world", type=int, default=2)
    # Worker mode (the bench starts itself once per rank).
    ap.add_argument("--worker", dest="mode")
    ap.add_argument("--rank", type=int)
    ap.add_argument("--rdzv")
    ap.add_argument("--coordinator")
    args = ap.parse_args()
    if args.mode:
        return worker(args)

    for var, rel in (("MAINSTAY_COORDINATOR_BIN", "server/grpc/mainstay-coordinator"),
                     ("MAINSTAYD_BIN", "server/grpc/mainstayd"), ("MAINSTAYCTL_BIN", "cli/mainstayctl")):
        os.environ.setdefault(var, os.path.join(args.build_dir, rel))
    os.environ.setdefault("PYTHONPATH", os.path.join(args.build_dir, "client", "python"))
    sys.path.insert(0, os.path.join(ROOT, "tests", "testing"))
    import process_cluster
    cluster = process_cluster.Cluster(daemons=args.world, lease_ms=10000,
                                      daemon_flags=["--memory-bytes", "12000000000"])
    rows = []
    try:
        for mode in args.modes.split(","):
            if mode not in MODES:
                sys.exit("unknown mode %r; modes: %s" % (mode, ", ".join(MODES)))
            print("== %s: %d ranks, %d steps after %d warmup" % (mode, args.world, args.steps, args.warmup),
                  file=sys.stderr, flush=True)
            rdzv = tempfile.mktemp(prefix="rdzv.", dir=cluster.dir)
            argv = [sys.executable, os.path.abspath(__file__), "--worker", mode, "--rdzv", rdzv,
                    "--coordinator", cluster.address]
            for k in ("recipe", "param_dtype", "dim", "layers", "heads", "vocab", "context", "batch", "bucket_numel",
                      "warmup", "steps", "world"):
                argv += ["--" + k.replace("_", "-"), str(getattr(args, k))]
            procs = [subprocess.Popen(argv + ["--rank", str(r)], stdout=subprocess.PIPE, text=True)
                     for r in range(args.world)]
            outs = [p.communicate(timeout=3600)[0] for p in procs]
            if any(p.returncode for p in procs):
                sys.exit("mode %s failed:\n%s\n%s" % (mode, "\n".join(outs), cluster.logs()))
            line = [l for l in outs[0].splitlines() if l.startswith("RESULT ")][0]
            rows.append(json.loads(line[len("RESULT "):]))
    finally:
        cluster.stop()

    base = {r[0]["mode"]: r for r in rows}.get("adamw")
    n = rows[0][0]["params"]
    print("torch_step_bench: %.1fM-parameter GPT (dim %d, %d layers, vocab %d, context %d), %s parameters, recipe %s, "
          "%d gloo ranks x batch %d, bucket_numel %d" % (n / 1e6, args.dim, args.layers, args.vocab, args.context,
                                                         args.param_dtype, args.recipe, args.world, args.batch,
                                                         args.bucket_numel))
    print("%-16s %10s %9s %18s %16s %15s" % ("mode", "step_s", "vs_adamw", "allgather_B/rank", "peak_RSS_B/param",
                                             "end_RSS_B/param"))
    for r in rows:
        step = statistics.mean(x["step_s"] for x in r)
        ratio = step / statistics.mean(x["step_s"] for x in base) if base else float("nan")
        peak = max(x["peak"] for x in r) / n
        end = max(x["end"] for x in r) / n
        print("%-16s %10.3f %9.2f %18d %16.2f %15.2f" % (r[0]["mode"], step, ratio, r[0]["allgather_bytes"], peak, end))


if __name__ == "__main__":
    main()
