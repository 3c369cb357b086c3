"""mainstay.torch: a PyTorch optimizer whose state lives in Mainstay's shard daemons.

``MainstayOptimizer`` registers a model's parameters as a Mainstay job and, on ``step()``,
reduce-scatters the gradients across the torch.distributed group, pushes this rank's shard to
its daemon, ends the step (``finish_step`` with ``lr`` and ``weight_decay`` of
``param_groups[0]``), pulls this rank's shard of the new version, dequantizes it and all-gathers
the FP32 values back into the parameters. The trainer keeps no optimizer state: FP32 masters
and AdamW moments live on the daemons (docs/torch.md).

    opt = MainstayOptimizer(model, "127.0.0.1:7070", recipe="bf16_mixed", lr=3e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=1000)
    for x, y in batches:
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()          # opt.last_stats: grad_norm, clip_factor, skipped, lr, version, ...
        opt.zero_grad()
        sched.step()

Importing this module imports torch; ``import mainstay`` alone does not.
"""
import json
import os
import sys
import time

import numpy as np
import torch
import torch.distributed as dist

from . import _mainstay

__all__ = ["MainstayOptimizer"]


def _dist_active(group):
    return dist.is_available() and dist.is_initialized() and (group is None or group != dist.GroupMember.NON_GROUP_MEMBER)


def _named_parameters(model):
    if isinstance(model, torch.nn.Module):
        return list(model.named_parameters())
    named = list(model)
    for item in named:
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)
                and isinstance(item[1], torch.Tensor)):
            raise TypeError("MainstayOptimizer: give a torch.nn.Module or an iterable of (name, parameter) "
                            "pairs (model.named_parameters()); got an item of type %s" % type(item).__name__)
    return named


class MainstayOptimizer(torch.optim.Optimizer):
    """AdamW (or SGD) on Mainstay's shard daemons, as a torch.optim.Optimizer.

    Args:
      model: a torch.nn.Module or its named_parameters(). Parameters with requires_grad=False
        are left out of the job. Every parameter must be float32, contiguous and on one device.
      client: a ``mainstay.Client`` already connected to the job (its layout must match the
        model), or the coordinator's "host:port": then rank 0 of the group creates the job from
        the model (names and shapes from named_parameters) and the other ranks attach with the
        job id and token rank 0 broadcasts; with ``job_id``/``job_token`` every rank attaches.
      lr, weight_decay: initial values of param_groups[0]; the values in param_groups[0] at
        each step() are sent with that step (so LR schedulers work).
      betas, eps, max_grad_norm, optimizer: the job's optimizer spec (fixed for the job).
      recipe: a recipe name (docs/job_spec.md), e.g. "bf16_mixed",
        "bf16_with_fp8_current_scaling_mixed".
      spec: extra job spec fields merged into the generated spec ("bucket_numel", "overrides",
        "layout_policy", "recipe_options", "name", ...).
      process_group: torch.distributed group of the data-parallel ranks (None: the default
        group, looked up at each call, so a re-initialized default group is picked up);
        without torch.distributed: one rank.
      resume: False: a fresh job; rank 0 pushes its parameters as version 0 and every rank
        loads version 0. True: this rank (re)joins a running job: it pushes nothing, and, with
        the other ranks calling resync() at the same time, loads the newest version.
      average_grads: divide the reduce-scattered sum by the group size (DDP's mean).
      timeout_s: deadline of each client operation; step_timeout_s: of finish_step (default
        timeout_s).
      admin_token: sent with the checkpoint admin calls of state_dict / load_state_dict.
    """

    def __init__(self, model, client, *, lr=1e-3, weight_decay=0.01, betas=(0.9, 0.999), eps=1e-8,
                 max_grad_norm=1.0, optimizer="adamw", recipe="bf16_mixed", spec=None, job_id=None,
                 job_token=None, process_group=None, resume=False, average_grads=True, timeout_s=60.0,
                 step_timeout_s=None, admin_token=""):
        named = [(n, p) for n, p in _named_parameters(model) if p.requires_grad]
        if not named:
            raise ValueError("MainstayOptimizer: the model has no parameter with requires_grad=True")
        self._check_params(named)
        self._group = process_group
        self._rank, self._world = self._rank_and_world()
        self._average = bool(average_grads)
        self._step_timeout_s = float(step_timeout_s if step_timeout_s is not None else timeout_s)
        self._admin_token = admin_token
        self._device = named[0][1].device
        defaults = dict(lr=lr, weight_decay=weight_decay, betas=tuple(betas), eps=eps, max_grad_norm=max_grad_norm)
        self._initializing = True
        super().__init__([p for _, p in named], defaults)
        self._initializing = False
        self._names = [n for n, _ in named]

        created = False
        if isinstance(client, str):
            job_spec = self._make_spec(named, recipe, optimizer, betas, eps, weight_decay, max_grad_norm, spec)
            client, created = self._connect(client, job_spec, job_id, job_token, timeout_s, admin_token)
        elif not isinstance(client, _mainstay.Client):
            raise TypeError("MainstayOptimizer: client must be a mainstay.Client or the coordinator's "
                            "\"host:port\", got %s" % type(client).__name__)
        self.client = client
        self.layout = client.layout
        self._check_job(named)
        self._build_buffers(named)
        self._next_step = 0
        self.version = None
        self.last_stats = None
        self.retried_steps = 0  # steps the daemons aborted and step() pushed again
        self.rewinds = 0        # restores from a checkpoint that step() resumed from
        if resume:
            self.resync()
        else:
            if self._rank == 0:
                for b in self._buckets:  # every shard from rank 0: the ranks' models may differ
                    client.push_initial_params(b["index"], self._host(self._param_flat[b["index"]]), all_shards=True)
            self._load_version(0)
        self.created_job = created  # True on the rank that created the job

    # ---- torch.optim.Optimizer surface.

    def add_param_group(self, param_group):
        if not self._initializing:
            raise ValueError("MainstayOptimizer has exactly one param group: one lr and weight_decay per step "
                             "are sent to the daemons, for every tensor of the job")
        super().add_param_group(param_group)

    @property
    def next_step(self):
        """The Mainstay step number the next step() pushes (committed steps + skipped ones)."""
        return self._next_step

    @property
    def job_id(self):
        return self.client.job_id

    @property
    def job_token(self):
        return self.client.job_token

    def zero_grad(self, set_to_none=None):
        """Zeros the flat gradient buffers in place. The parameters' .grad stay views into them
        (set_to_none is accepted and ignored: None grads would cost a copy per step)."""
        del set_to_none
        for flat in self._grad_flat:
            flat.zero_()
        self._alias_grads()

    @torch.no_grad()
    def step(self, closure=None):
        """One optimizer step: reduce-scatter, push, finish_step, pull, all-gather. Returns the
        closure's loss (if a closure was given); the StepStats dict is in ``last_stats``."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        group = self.param_groups[0]
        lr, weight_decay = float(group["lr"]), float(group["weight_decay"])
        step = self._next_step
        self._collect_grads()
        payloads, pushes = [], []
        for b in self._buckets:
            payloads.append(self._host(self._reduce_scatter(b)))
            pushes.append(self.client.push_grad(b["index"], step, payloads[-1], wait=False))
        for attempt in range(1, self.MAX_STEP_ATTEMPTS + 1):
            try:
                stats = self.client.finish_step(step, lr, weight_decay, timeout_s=self._step_timeout_s)
                for h in pushes:
                    h.wait()
                break
            except _mainstay.Error as e:
                for h in pushes:  # settle every push of this attempt before the next one
                    try:
                        h.wait()
                    except _mainstay.Error:
                        pass
                if e.code != "ABORTED" or attempt == self.MAX_STEP_ATTEMPTS:
                    raise
                resume = self._resume_step(e, step)
                if resume < step:
                    return self._rewind(resume, e, loss)
                # The daemons gave this step up and changed nothing (a peer lost mid-step, a
                # daemon left the placement): push the same gradients again.
                self.retried_steps += 1
                print("mainstay.torch: step %d of job %s was aborted (%s); pushing it again (attempt %d)"
                      % (step, self.client.job_id, e.message, attempt + 1), file=sys.stderr, flush=True)
                pushes = [self.client.push_grad(b["index"], step, p, wait=False)
                          for b, p in zip(self._buckets, payloads)]
        self._next_step = step + 1
        self.last_stats = stats
        if not stats["skipped"]:
            self._load_version(stats["version"])
        return loss

    # Attempts at one step before step() raises the daemons' ABORTED.
    MAX_STEP_ATTEMPTS = 8

    @staticmethod
    def _resume_step(error, step):
        """The step an ABORTED tells this trainer to run next: the daemons' committed step + 1
        when they say (a restore rewinds it below `step`), else `step` itself."""
        info = error.info or {}
        committed = info.get("committed_step")
        if committed is None or committed + 1 > step:
            return step
        return committed + 1

    def _rewind(self, resume, error, loss):
        """The job was restored from a checkpoint: its newest version belongs to step
        `resume` - 1. Loads it into the parameters (a collective: every rank gets the same
        ABORTED) and goes on from `resume`; this call's gradients are dropped, as a restart from
        that checkpoint would have dropped them."""
        probe = self.client.pull_shard(self._buckets[0]["index"], self._rank, _mainstay.Client.LATEST,
                                       timeout_s=self._step_timeout_s)
        print("mainstay.torch: job %s was restored to step %d (%s); resuming there at version %d"
              % (self.client.job_id, resume - 1, error.message, probe.version), file=sys.stderr, flush=True)
        self._next_step = resume
        self.rewinds += 1
        self.last_stats = None
        self._load_version(probe.version)
        return loss

    def state_dict(self):
        """A Mainstay checkpoint of the job (admin CreateCheckpoint, wait=True) plus the
        param_groups' hyperparameters. Call it on one rank between steps; it needs no
        collective. Raises mainstay.Error (code FAILED_PRECONDITION) on a coordinator started
        without --checkpoint-dir."""
        info = self.client.create_checkpoint(wait=True, admin_token=self._admin_token)
        if info["state"] != "COMMITTED":
            raise RuntimeError("state_dict: checkpoint %s of job %s is %s, not COMMITTED: %s" % (
                info["checkpoint_id"], info["job_id"], info["state"], info["error"] or "no reason given"))
        groups = []
        for g in self.param_groups:
            d = {k: v for k, v in g.items() if k != "params"}
            d["params"] = list(range(len(g["params"])))
            groups.append(d)
        return {
            "mainstay": {"checkpoint_id": info["checkpoint_id"], "version": info["version"],
                         "job_id": info["job_id"], "next_step": self._next_step},
            "param_groups": groups,
        }

    def load_state_dict(self, state_dict):
        """Restores a state_dict() checkpoint into this job (admin RestoreCheckpoint, by rank 0)
        and loads the restored version into the parameters on every rank. A collective: every
        rank of the group calls it."""
        if not isinstance(state_dict, dict) or "mainstay" not in state_dict:
            raise ValueError("load_state_dict: not a MainstayOptimizer state_dict (no \"mainstay\" entry); "
                             "a torch optimizer's state cannot be loaded into Mainstay's daemons")
        ms = state_dict["mainstay"]
        for key in ("checkpoint_id", "version", "next_step"):
            if key not in ms:
                raise ValueError("load_state_dict: state_dict[\"mainstay\"] lacks %r" % key)
        groups = state_dict.get("param_groups", [])
        if len(groups) != 1 or len(groups[0].get("params", [])) != len(self.param_groups[0]["params"]):
            raise ValueError("load_state_dict: expected one param group of %d parameters, got %s" % (
                len(self.param_groups[0]["params"]), [len(g.get("params", [])) for g in groups]))
        status = [None]
        if self._rank == 0:
            try:
                restored = self.client.restore_checkpoint(ms["checkpoint_id"], admin_token=self._admin_token)
                status = [("ok", restored["version"])]
            except _mainstay.Error as e:
                status = [("error", "%s: %s" % (e.code, e.message))]
        if self._world > 1:
            dist.broadcast_object_list(status, src=self._global_rank(0), group=self._group)
        kind, value = status[0]
        if kind != "ok":
            raise RuntimeError("load_state_dict: RestoreCheckpoint %s failed on rank 0: %s" % (ms["checkpoint_id"], value))
        if value != ms["version"]:
            raise RuntimeError("load_state_dict: checkpoint %s restored version %d, the state_dict says %d" % (
                ms["checkpoint_id"], value, ms["version"]))
        self.client.refresh_placement()  # every shard was reassigned
        for k, v in groups[0].items():
            if k != "params":
                self.param_groups[0][k] = v
        self._next_step = int(ms["next_step"])
        self._load_version(value)

    # ---- Faults.

    def resync(self):
        """Re-joins the group after a rank was restarted: every rank of the (re-initialized)
        group calls it at the same time (a restarted rank does so inside its constructor, with
        resume=True). Agrees on the next step, loads the newest version into the parameters,
        and leaves the gradients zeroed."""
        probe = self.client.pull_shard(self._buckets[0]["index"], self._rank, _mainstay.Client.LATEST,
                                       timeout_s=self._step_timeout_s)
        version = probe.version
        t = torch.tensor([self._next_step, version, -version], dtype=torch.int64)
        if self._world > 1:
            t = self._to_comm(t)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self._group)
            t = t.cpu()
        next_step, vmax, vmin = int(t[0]), int(t[1]), -int(t[2])
        if vmax != vmin:
            raise RuntimeError("resync: ranks see versions %d..%d of job %s; a step is still being committed, "
                               "call resync() again" % (vmin, vmax, self.client.job_id))
        self._next_step = max(next_step, version)  # step s makes version s + 1 unless skipped
        self._load_version(version)
        self.zero_grad()

    # ---- Internals.

    @staticmethod
    def _check_params(named):
        device = named[0][1].device
        for name, p in named:
            if p.dtype != torch.float32:
                raise TypeError("MainstayOptimizer: parameter %s is %s; keep the model's parameters in "
                                "torch.float32 (the daemons publish bf16/fp8 weights and the wrapper writes their "
                                "FP32 dequantized values; use autocast for lower-precision compute)" % (name, p.dtype))
            if not p.is_contiguous():
                raise ValueError("MainstayOptimizer: parameter %s is not contiguous (shape %s, stride %s); make it "
                                 "contiguous first, e.g. p.data = p.data.contiguous()" % (
                                     name, tuple(p.shape), p.stride()))
            if p.device != device:
                raise ValueError("MainstayOptimizer: parameter %s is on %s, %s is on %s; move the model to one "
                                 "device first" % (name, p.device, named[0][0], device))
            if p.is_sparse:
                raise ValueError("MainstayOptimizer: parameter %s is sparse" % name)

    def _rank_and_world(self):
        if _dist_active(self._group):
            return dist.get_rank(self._group), dist.get_world_size(self._group)
        return 0, 1

    def _global_rank(self, group_rank):
        if self._group is None:
            return group_rank
        return dist.distributed_c10d._get_global_rank(self._group, group_rank)

    def _backend(self):
        return dist.get_backend(self._group) if self._world > 1 else None

    def _to_comm(self, t):
        # NCCL only moves device tensors; gloo moves host (and device) tensors.
        if self._backend() == "nccl" and t.device.type != "cuda":
            return t.to(torch.device("cuda", torch.cuda.current_device()))
        return t

    @staticmethod
    def _make_spec(named, recipe, optimizer, betas, eps, weight_decay, max_grad_norm, extra):
        spec = {
            "name": "torch-%d-%d" % (os.getpid(), int(time.time() * 1000)),
            "recipe": recipe,
            "optimizer": {"type": optimizer, "beta1": float(betas[0]), "beta2": float(betas[1]), "eps": float(eps),
                          "weight_decay": float(weight_decay), "max_grad_norm": float(max_grad_norm)},
            "tensors": [{"name": n, "shape": list(p.shape) if p.dim() > 0 else [1]} for n, p in named],
        }
        if optimizer == "sgd":
            spec["optimizer"] = {"type": "sgd", "weight_decay": float(weight_decay), "max_grad_norm": float(max_grad_norm)}
        for k, v in (extra or {}).items():
            spec[k] = v
        return spec

    def _connect(self, coordinator, job_spec, job_id, job_token, timeout_s, admin_token):
        if (job_id is None) != (job_token is None):
            raise ValueError("MainstayOptimizer: give both job_id and job_token (attach) or neither (create)")
        kw = dict(rank=self._rank, timeout_s=timeout_s, admin_token=admin_token)
        if job_id is not None:
            return _mainstay.Client(coordinator, job_id=job_id, job_token=job_token, **kw), False
        job_spec["data_parallel_size"] = self._world
        box = [None]
        client, error = None, None
        if self._rank == 0:
            try:
                client = _mainstay.Client(coordinator, spec_json=json.dumps(job_spec), **kw)
                box = [("ok", client.job_id, client.job_token)]
            except _mainstay.Error as e:
                error = e
                box = [("error", "%s: %s" % (e.code, e.message), None)]
        if self._world > 1:  # the other ranks learn the job (or rank 0's failure) from rank 0
            dist.broadcast_object_list(box, src=self._global_rank(0), group=self._group)
        kind, a, b = box[0]
        if error is not None:
            raise error
        if kind != "ok":
            raise RuntimeError("MainstayOptimizer: rank 0 could not create the job: " + a)
        if client is None:
            client = _mainstay.Client(coordinator, job_id=a, job_token=b, **kw)
        return client, True

    def _check_job(self, named):
        c = self.client
        if c.data_parallel_size != self._world:
            raise ValueError("MainstayOptimizer: job %s has data_parallel_size %d but the process group has %d "
                             "ranks" % (c.job_id, c.data_parallel_size, self._world))
        if c.rank != self._rank:
            raise ValueError("MainstayOptimizer: the client is rank %d but this process is rank %d of the group" % (
                c.rank, self._rank))
        job = {t["name"]: tuple(t["shape"]) for t in self.layout.tensors}
        model = {n: tuple(p.shape) if p.dim() > 0 else (1,) for n, p in named}
        missing = sorted(set(model) - set(job))
        extra = sorted(set(job) - set(model))
        wrong = sorted(n for n in set(model) & set(job) if model[n] != job[n])
        if missing or extra or wrong:
            parts = []
            if missing:
                parts.append("not in the job: %s" % ", ".join(missing[:5]))
            if extra:
                parts.append("in the job but not trainable in the model: %s" % ", ".join(extra[:5]))
            for n in wrong[:5]:
                parts.append("%s has shape %s in the model, %s in the job" % (n, model[n], job[n]))
            raise ValueError("MainstayOptimizer: the model's parameters do not match job %s (%s)" % (
                c.job_id, "; ".join(parts)))

    def _build_buffers(self, named):
        layout = self.layout
        by_name = dict(named)
        self._buckets = layout.buckets
        self._param_flat, self._grad_flat, self._recv, self._views = [], [], [], []
        self._shard = []  # (lo, hi) of this rank's shard per bucket
        for b in self._buckets:
            n, sn, d = b["numel"], b["shard_numel"], self._world
            for r in range(d):
                if tuple(layout.shard_range(b["index"], r)) != (r * sn, (r + 1) * sn):
                    raise RuntimeError("MainstayOptimizer: bucket %d shard %d is not [r * shard_numel, (r+1) * "
                                       "shard_numel)" % (b["index"], r))
            pflat = torch.zeros(n, dtype=torch.float32, device=self._device)
            gflat = torch.zeros(n, dtype=torch.float32, device=self._device)
            views = []
            for t in b["tensors"]:
                info = layout.tensors[t]
                p = by_name[info["name"]]
                off, numel = info["bucket_offset"], info["numel"]
                pv = pflat[off:off + numel].view(p.shape)
                pv.copy_(p.detach())
                p.data = pv  # the parameter now lives in the flat bucket: the all-gather writes it
                views.append((p, gflat[off:off + numel].view(p.shape)))
            self._param_flat.append(pflat)
            self._grad_flat.append(gflat)
            self._recv.append(torch.empty(n, dtype=torch.float32, device=self._device) if d > 1 else None)
            self._views.append(views)
            self._shard.append((self._rank * sn, (self._rank + 1) * sn))
        self._host_staging = {}
        self._alias_grads()

    def _alias_grads(self):
        for views in self._views:
            for p, gv in views:
                if p.grad is None or p.grad.data_ptr() != gv.data_ptr():
                    p.grad = gv

    def _collect_grads(self):
        # Backward accumulates into the .grad views in place; a .grad replaced by user code
        # (model.zero_grad(set_to_none=True), manual assignment) is copied in, a missing one is 0.
        for views in self._views:
            for p, gv in views:
                g = p.grad
                if g is None:
                    gv.zero_()
                elif g.data_ptr() != gv.data_ptr():
                    gv.copy_(g)
        self._alias_grads()

    def _reduce_scatter(self, b):
        i = b["index"]
        lo, hi = self._shard[i]
        flat = self._grad_flat[i]
        if self._world == 1:
            shard = flat
        elif self._backend() == "nccl":
            shard = self._recv[i][lo:hi]
            dist.reduce_scatter_tensor(shard, flat, op=dist.ReduceOp.SUM, group=self._group)
        else:
            # Gloo has no reduce-scatter: an all-to-all gives every rank the D copies of its own
            # shard, summed here in rank order (deterministic).
            recv = self._recv[i]
            dist.all_to_all_single(recv, flat, group=self._group)
            shard = recv.view(self._world, hi - lo).sum(dim=0)
        if self._average and self._world > 1:
            shard = shard / self._world
        return shard

    def _host(self, t):
        """A numpy view of `t` (CPU) or of a host copy of it (device tensors)."""
        if t.device.type == "cpu":
            return t.contiguous().numpy()
        return t.detach().to("cpu").numpy()

    def _load_version(self, version):
        """Pulls this rank's shard of every bucket at `version`, dequantizes it into its slice of
        the flat parameter buffers and all-gathers the slices."""
        handles = [self.client.pull_shard(b["index"], self._rank, version, wait=False, timeout_s=self._step_timeout_s)
                   for b in self._buckets]
        for b, h in zip(self._buckets, handles):
            i = b["index"]
            pulled = h.wait()
            if pulled.unchanged:
                raise RuntimeError("MainstayOptimizer: version %d of job %s is unchanged (a skipped step) but the "
                                   "step said it was committed" % (version, self.client.job_id))
            lo, hi = self._shard[i]
            shard = self._param_flat[i][lo:hi]
            if shard.device.type == "cpu":
                pulled.dequantize_covered(out=shard.numpy())  # in place: no copy
            else:
                shard.copy_(torch.from_numpy(pulled.dequantize_covered()))
            if self._world > 1:
                self._all_gather(i)
        self.version = version

    def _all_gather(self, i):
        flat = self._param_flat[i]
        lo, hi = self._shard[i]
        if self._backend() == "nccl":
            dist.all_gather_into_tensor(flat, flat[lo:hi].clone(), group=self._group)
        else:
            outs = list(flat.view(self._world, hi - lo).unbind(0))
            dist.all_gather(outs, flat[lo:hi].clone(), group=self._group)
