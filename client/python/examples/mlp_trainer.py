"""A data-parallel trainer that keeps no optimizer state: a NumPy MLP learning a teacher network.

Each rank computes gradients on its own batches and pushes them unreduced (the daemons sum the
ranks in FP32 and run AdamW on the FP32 masters); it then pulls the next version's quantized
weights and dequantizes them for its forward pass. Rank 0 creates the job and writes
--job-file (job id and token); the other ranks wait for that file and attach.

    PYTHONPATH=build/client/python python3 client/python/examples/mlp_trainer.py \
        --coordinator 127.0.0.1:7070 --rank 0 --world 2 --job-file /tmp/job.json --steps 300
"""
import argparse
import json
import os
import sys
import time

import numpy as np

import mainstay

IN, HIDDEN, OUT, BATCH = 64, 128, 32, 256


def spec(world, recipe):
    return {
        "name": "mlp-demo-%d" % int(time.time() * 1000),
        "recipe": recipe,
        "data_parallel_size": world,
        "unreduced_pushes": True,  # each rank pushes its own whole gradient; the daemons sum them
        "optimizer": {"type": "adamw", "beta1": 0.9, "beta2": 0.99, "weight_decay": 0.0, "max_grad_norm": 1.0},
        "tensors": [
            {"name": "layers.0.fc1.weight", "shape": [HIDDEN, IN]},
            {"name": "layers.0.fc1.bias", "shape": [HIDDEN]},
            {"name": "layers.1.fc2.weight", "shape": [OUT, HIDDEN]},
            {"name": "layers.1.fc2.bias", "shape": [OUT]},
        ],
    }


def init_params(seed):
    rng = np.random.default_rng(seed)
    return {
        "layers.0.fc1.weight": (rng.standard_normal((HIDDEN, IN)) / np.sqrt(IN)).astype(np.float32),
        "layers.0.fc1.bias": np.zeros(HIDDEN, np.float32),
        "layers.1.fc2.weight": (rng.standard_normal((OUT, HIDDEN)) / np.sqrt(HIDDEN)).astype(np.float32),
        "layers.1.fc2.bias": np.zeros(OUT, np.float32),
    }


def forward(p, x):
    h = np.maximum(x @ p["layers.0.fc1.weight"].T + p["layers.0.fc1.bias"], 0.0)
    return h, h @ p["layers.1.fc2.weight"].T + p["layers.1.fc2.bias"]


def loss_and_grads(p, x, target):
    h, y = forward(p, x)
    loss = float(np.mean((y - target) ** 2))
    dy = 2.0 * (y - target) / y.size
    dh = (dy @ p["layers.1.fc2.weight"]) * (h > 0)
    grads = {
        "layers.1.fc2.weight": dy.T @ h,
        "layers.1.fc2.bias": dy.sum(0),
        "layers.0.fc1.weight": dh.T @ x,
        "layers.0.fc1.bias": dh.sum(0),
    }
    return loss, {k: v.astype(np.float32) for k, v in grads.items()}


def connect(args):
    if args.rank == 0:
        client = mainstay.Client(args.coordinator, spec_json=json.dumps(spec(args.world, args.recipe)), rank=0)
        tmp = args.job_file + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"job_id": client.job_id, "job_token": client.job_token, "coordinator": args.coordinator}, f)
        os.replace(tmp, args.job_file)  # the other ranks never see a partial file
        return client
    deadline = time.time() + 120
    while not os.path.exists(args.job_file):
        if time.time() > deadline:
            sys.exit("rank %d: no job file %s after 120 s" % (args.rank, args.job_file))
        time.sleep(0.05)
    with open(args.job_file) as f:
        job = json.load(f)
    return mainstay.Client(args.coordinator, job_id=job["job_id"], job_token=job["job_token"], rank=args.rank)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--coordinator", required=True)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--job-file", required=True)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--recipe", default="bf16_mixed")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--print-every", type=int, default=25)
    args = ap.parse_args()

    client = connect(args)
    layout = client.layout
    buckets = [b["index"] for b in layout.buckets]
    names = {b: [layout.tensors[t]["name"] for t in layout.buckets[b]["tensors"]] for b in buckets}
    teacher = init_params(1234)
    params = init_params(7)  # every rank starts from the same weights; each pushes its own shard
    for b in buckets:
        client.push_initial_params(b, layout.flatten(b, {n: params[n] for n in names[b]}))

    rng = np.random.default_rng(100 + args.rank)  # each rank sees its own data
    version, t_start = 0, time.time()
    for step in range(args.steps):
        t0 = time.time()
        pulls = [client.pull_bucket(b, version, wait=False) for b in buckets]
        for h in pulls:
            pulled = h.wait()
            if not pulled.unchanged:  # a skipped step keeps the weights held
                params.update(pulled.dequantize_all())
        x = rng.standard_normal((BATCH, IN)).astype(np.float32)
        loss, grads = loss_and_grads(params, x, forward(teacher, x)[1])
        for b in buckets:  # pre-divided by D: the daemons sum the ranks
            flat = layout.flatten(b, {n: grads[n] / np.float32(args.world) for n in names[b]})
            client.push_bucket_unreduced(b, step, flat)
        stats = client.finish_step(step, lr=args.lr, weight_decay=0.0)
        version = stats["version"]
        if args.rank == 0 and (step % args.print_every == 0 or step == args.steps - 1):
            print("step %4d  loss %.5f  grad_norm %.4f  clip %.3f  step %5.1f ms%s" % (
                step, loss, stats["grad_norm"], stats["clip_factor"], (time.time() - t0) * 1000,
                "  (skipped)" if stats["skipped"] else ""), flush=True)
    if args.rank == 0:
        print("done: %d steps in %.1f s, version %d" % (args.steps, time.time() - t_start, version), flush=True)


if __name__ == "__main__":
    main()
