"""A small GPT-style character-level language model trained through mainstay.torch.

Two (or more) processes, one per data-parallel rank, joined by torch.distributed (gloo, CPU).
MainstayOptimizer keeps no optimizer state in the trainers: each step it reduce-scatters the
gradients, pushes this rank's shard to its Mainstay daemon, and all-gathers the new (quantized,
dequantized) weights. With --reference, the same processes also train a copy of the model with
torch.optim.AdamW whose forward uses quantize-dequantized weights (the same recipe, reproduced
in PyTorch), on the same batches, and print both losses per step.

    PYTHONPATH=build/client/python /usr/bin/python3 client/python/examples/char_lm.py \\
        --coordinator 127.0.0.1:7070 --rank 0 --world 2 --job-file /tmp/lm/job.json --reference

Rank 0 creates the job and writes --job-file (job id and token). A restarted rank passes
--resume: it attaches with the job file, re-forms the torch.distributed group with the ranks
still running (file rendezvous, one generation per re-forming, in --rdzv-dir) and continues from
the current version; the surviving ranks notice the failure in a collective or in finish_step,
re-form the group and call MainstayOptimizer.resync().
"""
import argparse
import datetime
import json
import math
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from mainstay.torch import MainstayOptimizer

TEXT = "/usr/share/common-licenses/GPL-3"


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(dim)
        self.attn = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln_2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 4 * dim)
        self.fc_out = nn.Linear(4 * dim, dim)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.attn(self.ln_1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(c // self.heads)
        mask = torch.ones(t, t, dtype=torch.bool).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, c)
        x = x + self.proj(y)
        return x + self.fc_out(F.gelu(self.fc(self.ln_2(x))))


class CharGPT(nn.Module):
    def __init__(self, vocab, dim, layers, heads, context):
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.wpe = nn.Embedding(context, dim)
        self.layers = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.layers:
            x = block(x)
        return self.lm_head(self.ln_f(x))


# ---- The reference: what the daemons do, in PyTorch (quantize-dequantize of the weights).

def qdq_bf16(w):
    return w.to(torch.bfloat16).float()


def qdq_fp8_e4m3_current(w):
    """Per-tensor current scaling (shared/FORMATS.md): amax of the bf16 value, scale = 448 / amax,
    q = E4M3(RNE, x * scale), value = q * RN(1 / scale)."""
    x = qdq_bf16(w)
    amax = x.abs().max()
    if not torch.isfinite(amax) or amax == 0:
        scale = torch.tensor(1.0)
    else:
        scale = torch.tensor(448.0) / amax
    scale_inv = (torch.tensor(1.0) / scale).float()
    y = x * scale
    a = y.abs()
    _, e = torch.frexp(a)
    e = (e - 1).clamp(min=-6)  # exponent of the leading bit; E4M3 subnormals below 2^-6
    quantum = torch.pow(2.0, (e - 3).float())
    q = (torch.round(a / quantum) * quantum).clamp(max=448.0)
    return torch.sign(y) * q * scale_inv


QDQ = {"bf16": qdq_bf16, "fp8_e4m3_current": qdq_fp8_e4m3_current}


class Reference:
    """torch.optim.AdamW on FP32 masters, with the same param groups and lr schedule, whose
    forward uses the quantize-dequantized weights (a straight-through estimator: gradients of
    the dequantized weights update the masters), in the trainer's parameter dtype (bf16: the
    forward and backward run in bf16, the averaged gradient is rounded to bf16 as the trainers
    push it); gradients averaged over the ranks and clipped by global norm, like the daemons."""

    def __init__(self, model, formats, args):
        for name, fmt in formats.items():
            if fmt not in QDQ:
                sys.exit("the reference reproduces %s, not %s (tensor %s): pick another --recipe" % (
                    ", ".join(sorted(QDQ)), fmt, name))
        self.model = model
        self.formats = formats
        self.args = args
        self.dtype = PARAM_DTYPES[args.param_dtype]
        self.opt = torch.optim.AdamW(param_groups(model, args), lr=args.lr, betas=(0.9, 0.95), eps=1e-8,
                                     weight_decay=args.weight_decay)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, schedules(args))

    def step(self, x, y):
        params = dict(self.model.named_parameters())
        masters = {n: p.data for n, p in params.items()}
        for n, p in params.items():
            p.data = QDQ[self.formats[n]](masters[n]).to(self.dtype)
        loss = F.cross_entropy(self.model(x).flatten(0, 1).float(), y.flatten())
        loss.backward()
        grads = []
        for n, p in params.items():
            grads.append(p.grad.float())
            p.data, p.grad = masters[n], None
        flat = torch.cat([g.flatten() for g in grads])
        if dist.get_world_size() > 1:
            dist.all_reduce(flat)
            flat /= dist.get_world_size()
        flat = flat.to(self.dtype).float()
        offset = 0
        for p, g in zip(params.values(), grads):
            p.grad = flat[offset:offset + g.numel()].view_as(g).clone()
            offset += g.numel()
        torch.nn.utils.clip_grad_norm_(list(params.values()), self.args.max_grad_norm)
        self.opt.step()
        self.opt.zero_grad()
        self.sched.step()
        return loss.detach()


PARAM_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def param_groups(model, args):
    """--param-groups 1: every parameter; 2: nanoGPT's configure_optimizers (weight decay on the
    2-D weights, none on biases and norms); 3: those two plus the embeddings in a group of their
    own with half the lr."""
    named = list(model.named_parameters())
    if args.param_groups == 1:
        return [p for _, p in named]
    embed = [p for n, p in named if n.startswith(("wte.", "wpe.")) and args.param_groups == 3]
    decay = [p for n, p in named if p.dim() >= 2 and not any(p is e for e in embed)]
    no_decay = [p for _, p in named if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if args.param_groups == 3:
        groups.append({"params": embed, "weight_decay": args.weight_decay, "lr": args.lr / 2})
    return groups


def schedules(args):
    """One LambdaLR factor per group: the --schedule for the first two, and with three groups a
    warmup-then-constant schedule of its own for the embeddings."""
    main = lambda s: lr_at(args, s) / args.lr  # noqa: E731
    if args.param_groups < 3:
        return main
    return [main, main, lambda s: min(1.0, (s + 1) / 5)]


# ---- Data, process group, main loop.

def load_text(path):
    with open(path, encoding="utf-8", errors="replace") as f:
        text = f.read()
    chars = sorted(set(text))
    index = {c: i for i, c in enumerate(chars)}
    return torch.tensor([index[c] for c in text], dtype=torch.long), len(chars)


def batch(data, step, rank, batch_size, context):
    # Deterministic per (step, rank): a restarted rank recomputes the same batch.
    g = torch.Generator().manual_seed(1_000_003 * step + rank)
    starts = torch.randint(0, len(data) - context - 1, (batch_size,), generator=g)
    x = torch.stack([data[s:s + context] for s in starts])
    y = torch.stack([data[s + 1:s + context + 1] for s in starts])
    return x, y


def join_group(args, generation):
    """File rendezvous of one generation of the group; the generation number is kept in
    rdzv_dir/generation so that a restarted rank joins the one the others are moving to."""
    dist.init_process_group("gloo", init_method="file://%s/gen%d" % (args.rdzv_dir, generation), rank=args.rank,
                            world_size=args.world, timeout=datetime.timedelta(seconds=args.rdzv_timeout))
    tmp = os.path.join(args.rdzv_dir, "generation.%d.tmp" % args.rank)
    with open(tmp, "w") as f:
        f.write(str(generation))
    os.replace(tmp, os.path.join(args.rdzv_dir, "generation"))


def current_generation(args):
    try:
        with open(os.path.join(args.rdzv_dir, "generation")) as f:
            return int(f.read())
    except FileNotFoundError:
        return -1


def read_job(path, timeout_s=120):
    deadline = time.time() + timeout_s
    while not os.path.exists(path):
        if time.time() > deadline:
            sys.exit("no job file %s after %d s" % (path, timeout_s))
        time.sleep(0.05)
    with open(path) as f:
        return json.load(f)


def lr_at(args, step):
    return args.lr if args.schedule == "constant" else args.lr * 0.5 * (1 + math.cos(math.pi * step / args.steps))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--coordinator", required=True)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--job-file", required=True, help="rank 0 writes the job id and token here")
    ap.add_argument("--rdzv-dir", help="torch.distributed file rendezvous (default: the job file's folder)")
    ap.add_argument("--rdzv-timeout", type=float, default=120.0)
    ap.add_argument("--resume", action="store_true", help="re-join a running job after a restart")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--recipe", default="bf16_mixed")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--schedule", choices=["constant", "cosine"], default="constant",
                    help="cosine: torch.optim.lr_scheduler.LambdaLR over --steps")
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--max-grad-norm", type=float, default=1.0)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16, help="sequences per rank and step")
    ap.add_argument("--bucket-numel", type=int, default=65536, help="job spec bucket_numel (several buckets)")
    ap.add_argument("--replication", type=int, default=1,
                    help="job spec replication_factor: copies of each shard's state on distinct daemons")
    ap.add_argument("--reference", action="store_true", help="also train the torch.optim.AdamW reference")
    ap.add_argument("--param-groups", type=int, choices=[1, 2, 3], default=1,
                    help="1: one group; 2: decay / no decay; 3: plus the embeddings with their own lr and schedule")
    ap.add_argument("--param-dtype", choices=sorted(PARAM_DTYPES), default="fp32",
                    help="the trainer's parameters (bf16: gradients pushed in BF16, FP32 masters on the daemons)")
    ap.add_argument("--reduce", choices=["scatter", "unreduced"], default="scatter")
    ap.add_argument("--allgather", choices=["quantized", "fp32"], default="quantized")
    ap.add_argument("--no-overlap", action="store_true", help="reduce and push every bucket in step()")
    ap.add_argument("--step-timeout", type=float, default=60.0, help="finish_step deadline, seconds")
    ap.add_argument("--text", default=TEXT)
    ap.add_argument("--all-ranks-print", action="store_true")
    ap.add_argument("--print-every", type=int, default=1, help="print every n-th step (and the last)")
    ap.add_argument("--require-drop", type=float, default=0.0,
                    help="exit 1 unless the last step's loss is below (1 - this) x the first step's")
    args = ap.parse_args()
    if args.reference and args.resume:
        sys.exit("--reference cannot resume: its optimizer state lives in the process")
    args.rdzv_dir = args.rdzv_dir or os.path.dirname(os.path.abspath(args.job_file))
    torch.set_num_threads(1)

    data, vocab = load_text(args.text)
    torch.manual_seed(0)  # every rank builds the same initial model
    model = CharGPT(vocab, args.dim, args.layers, args.heads, args.context)
    model = model.to(PARAM_DTYPES[args.param_dtype])
    ref_model = CharGPT(vocab, args.dim, args.layers, args.heads, args.context)
    ref_model.load_state_dict(model.state_dict())  # FP32 masters of the same (rounded) values

    generation = current_generation(args) + 1 if args.resume else 0
    join_group(args, generation)
    kw = dict(recipe=args.recipe, lr=args.lr, weight_decay=args.weight_decay, betas=(0.9, 0.95), eps=1e-8,
              max_grad_norm=args.max_grad_norm, spec={"bucket_numel": args.bucket_numel, "replication_factor": args.replication},
              step_timeout_s=args.step_timeout, params=param_groups(model, args), reduce=args.reduce,
              allgather=args.allgather, overlap=not args.no_overlap)
    if args.resume:
        job = read_job(args.job_file)
        opt = MainstayOptimizer(model, args.coordinator, job_id=job["job_id"], job_token=job["job_token"],
                                resume=True, **kw)
    else:
        opt = MainstayOptimizer(model, args.coordinator, **kw)
        if args.rank == 0:
            tmp = args.job_file + ".tmp"
            with open(tmp, "w") as f:
                json.dump({"job_id": opt.job_id, "job_token": opt.job_token, "coordinator": args.coordinator}, f)
            os.replace(tmp, args.job_file)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedules(args))
    formats = {t["name"]: t["format"] for t in opt.layout.tensors}
    ref = Reference(ref_model, formats, args) if args.reference else None
    loud = args.rank == 0 or args.all_ranks_print
    if loud:
        print("rank %d: job %s, %d tensors in %d buckets, %d parameters, recipe %s, formats %s, starting at step %d"
              % (args.rank, opt.job_id, len(opt.layout.tensors), len(opt.layout.buckets),
                 sum(p.numel() for p in model.parameters()), args.recipe, sorted(set(formats.values())),
                 opt.next_step), flush=True)

    t_start = time.time()
    first_loss = last_loss = None
    while opt.next_step < args.steps:
        step = opt.next_step
        while sched.last_epoch < step:  # the schedule follows Mainstay's step count (also after a resume)
            sched.step()
        try:
            t0 = time.time()
            x, y = batch(data, step, args.rank, args.batch, args.context)
            loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses = [loss.detach()]
            if ref is not None:
                losses.append(ref.step(x, y))
            mean = torch.stack(losses)
            dist.all_reduce(mean)
            mean /= args.world
        except RuntimeError as e:  # a rank died (gloo) or its step did not finish (mainstay.Error)
            print("rank %d: step %d failed: %s; re-forming the group" % (args.rank, step, str(e).splitlines()[0]),
                  flush=True)
            if ref is not None:
                raise
            dist.destroy_process_group()
            generation += 1
            join_group(args, generation)
            opt.resync()
            print("rank %d: re-joined generation %d at step %d, version %d" % (
                args.rank, generation, opt.next_step, opt.version), flush=True)
            continue
        stats = opt.last_stats
        if stats is None:  # the job was restored from a checkpoint: step() rewound to it
            if loud:
                print("rank %d: step %d rewound: the job resumes at step %d, version %d" % (
                    args.rank, step, opt.next_step, opt.version), flush=True)
            continue
        first_loss = float(mean[0]) if first_loss is None else first_loss
        last_loss = float(mean[0])
        if loud and (step % args.print_every == 0 or step == args.steps - 1):
            line = "rank %d step %3d  loss %.4f" % (args.rank, step, mean[0])
            if ref is not None:
                line += "  reference %.4f  gap %+.4f" % (mean[1], mean[0] - mean[1])
            lrs = "/".join("%.2e" % g["lr"] for g in stats["groups"])
            print(line + "  lr %s  grad_norm %.3f  clip %.3f  version %d  %.0f ms%s" % (
                lrs, stats["grad_norm"], stats["clip_factor"], stats["version"], (time.time() - t0) * 1e3,
                "  (skipped)" if stats["skipped"] else ""), flush=True)
    if loud:
        print("rank %d: parameter all-gather sent %d bytes per step (%s)" % (args.rank, opt.allgather_bytes,
                                                                            args.allgather), flush=True)
        print("rank %d done: %d steps in %.1f s, version %d" % (args.rank, opt.next_step, time.time() - t_start,
                                                               opt.version), flush=True)
    dist.destroy_process_group()
    if args.require_drop > 0 and first_loss is not None and not last_loss < (1 - args.require_drop) * first_loss:
        sys.exit("the loss went from %.4f to %.4f: it did not drop by %.0f%%" % (first_loss, last_loss,
                                                                              100 * args.require_drop))


if __name__ == "__main__":
    main()
