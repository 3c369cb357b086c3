"""mainstay.torch: a PyTorch optimizer whose state lives in Mainstay's shard daemons.

``MainstayOptimizer`` registers a model's parameters as a Mainstay job and trains it as
``torch.optim.AdamW`` would, with the FP32 masters and moments on the daemons:

- backward hooks start the reduce-scatter of a bucket as soon as its gradients are complete,
  and a background thread pushes each reduced shard to its daemon (``overlap=True``);
- ``step()`` finishes the step with every param group's ``lr`` and ``weight_decay``, pulls this
  rank's shard of the new version, all-gathers the published (quantized) bytes among the ranks
  and dequantizes them locally into the parameters;
- faults the daemons recover from (an aborted step, a moved shard, a failover, a restore) are
  handled inside ``step()``.

    opt = MainstayOptimizer(model, "127.0.0.1:7070", params=groups, recipe="bf16_mixed", lr=3e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=1000)
    for x, y in batches:
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()          # opt.last_stats: grad_norm, clip_factor, skipped, groups, version, ...
        opt.zero_grad()
        sched.step()

docs/torch.md has the details. Importing this module imports torch; ``import mainstay`` alone
does not.
"""
import contextlib
import json
import os
import queue
import sys
import threading
import time
import weakref

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


# Keys of a param group that the daemons apply per step; the others must not differ from the job's.
_STEP_KEYS = ("lr", "weight_decay")
_JOB_KEYS = ("betas", "eps", "max_grad_norm")


class MainstayOptimizer(torch.optim.Optimizer):
    """AdamW (or SGD) on Mainstay's shard daemons, as a torch.optim.Optimizer.

    Args:
      model: a torch.nn.Module or its named_parameters(). Names come from it; parameters with
        requires_grad=False are left out of the job. Every parameter must be contiguous, on one
        device, and all of one dtype: torch.float32, or torch.bfloat16 (then gradients are
        pushed in BF16 and the FP32 masters exist only on the daemons).
      client: a ``mainstay.Client`` already connected to the job (its layout must match the
        model and the param groups), or the coordinator's "host:port": then rank 0 of the group
        creates the job from the model (names, shapes, param groups) and the other ranks attach
        with the job id and token rank 0 broadcasts; with ``job_id``/``job_token`` every rank
        attaches.
      params: what torch.optim.AdamW takes: an iterable of parameters, or of param-group dicts,
        each with "params" and optionally its own "lr" and "weight_decay" (and any keys a
        scheduler adds). Every group's lr and weight_decay at each step() are sent with that
        step. "betas", "eps" and "max_grad_norm" are the job's, for every group: a group that
        sets other values is refused. None: every trainable parameter, one group. A trainable
        parameter in no group is left out of the job (never updated), as torch does.
      lr, weight_decay: defaults of the groups (torch.optim semantics).
      betas, eps, max_grad_norm, optimizer: the job's optimizer spec (fixed for the job).
      recipe: a recipe name (docs/job_spec.md), e.g. "bf16_mixed",
        "bf16_with_fp8_current_scaling_mixed".
      spec: extra job spec fields merged into the generated spec ("bucket_numel", "overrides",
        "layout_policy", "recipe_options", "name", "replication_factor", ...).
      process_group: torch.distributed group of the data-parallel ranks (None: the default
        group, looked up at each call); without torch.distributed: one rank.
      resume: False: a fresh job; rank 0 pushes its parameters as version 0 and every rank
        loads version 0. True: this rank (re)joins a running job: it pushes nothing, and, with
        the other ranks calling resync() at the same time, loads the newest version.
      average_grads: divide the summed gradient by the group size (DDP's mean).
      reduce: "scatter" (default): the ranks reduce-scatter each bucket and push the reduced
        shard, in the parameters' dtype. "unreduced": each rank pushes its own gradient of every
        shard and the daemons sum the D contributions in FP32 (Megatron's
        reduce_scatter_with_fp32_accumulation; the job gets unreduced_pushes).
      allgather: "quantized" (default): the ranks all-gather the published bytes and scales of
        each bucket and dequantize locally. "fp32": each rank dequantizes its shard and the
        ranks all-gather FP32 (4 B per element on the wire).
      overlap: True (default): backward hooks start a bucket's reduce-scatter (or unreduced
        push) as soon as its gradients are complete, and a background thread pushes it. Every
        rank must then produce gradients for the same parameters in each backward (as DDP
        without find_unused_parameters); wrap the backward passes of gradient accumulation but
        the last in ``opt.no_sync()``. False: all of it happens in step().
      timeout_s: deadline of each client operation; step_timeout_s: of finish_step (default
        timeout_s).
      admin_token: sent with the checkpoint admin calls of state_dict / load_state_dict.

    Thread safety: one training loop drives it (as any torch optimizer).
    """

    # Attempts at one step before step() raises the daemons' ABORTED.
    MAX_STEP_ATTEMPTS = 8
    # Buckets whose collective may be in flight at once (each holds a bucket-sized buffer).
    MAX_IN_FLIGHT = 2

    def __init__(self, model, client, params=None, *, lr=1e-3, weight_decay=0.01, betas=(0.9, 0.999), eps=1e-8,
                 max_grad_norm=1.0, optimizer="adamw", recipe="bf16_mixed", spec=None, job_id=None,
                 job_token=None, process_group=None, resume=False, average_grads=True, reduce="scatter",
                 allgather="quantized", overlap=True, timeout_s=60.0, step_timeout_s=None, admin_token=""):
        if reduce not in ("scatter", "unreduced"):
            raise ValueError("MainstayOptimizer: reduce must be \"scatter\" or \"unreduced\", got %r" % (reduce,))
        if allgather not in ("quantized", "fp32"):
            raise ValueError("MainstayOptimizer: allgather must be \"quantized\" or \"fp32\", got %r" % (allgather,))
        trainable = [(n, p) for n, p in _named_parameters(model) if p.requires_grad]
        if not trainable:
            raise ValueError("MainstayOptimizer: the model has no parameter with requires_grad=True")
        groups = self._groups_of(params, trainable)
        group_of = self._group_index(groups, trainable)
        named = [(n, p) for n, p in trainable if id(p) in group_of]
        if not named:
            raise ValueError("MainstayOptimizer: no param group holds a trainable parameter of the model")
        self._check_params(named)
        self._group = process_group
        self._rank, self._world = self._rank_and_world()
        self._average = bool(average_grads)
        self._reduce = reduce
        self._allgather = allgather
        self._overlap = bool(overlap)
        self._step_timeout_s = float(step_timeout_s if step_timeout_s is not None else timeout_s)
        self._admin_token = admin_token
        self._device = named[0][1].device
        self._dtype = named[0][1].dtype
        defaults = dict(lr=lr, weight_decay=weight_decay, betas=tuple(betas), eps=eps, max_grad_norm=max_grad_norm)
        self._initializing = True
        super().__init__(groups, defaults)
        self._initializing = False
        self._check_groups()
        self._group_of_name = {n: group_of[id(p)] for n, p in named}

        created = False
        if isinstance(client, str):
            job_spec = self._make_spec(named, self._group_of_name, recipe, optimizer, betas, eps, weight_decay,
                                       max_grad_norm, spec, reduce == "unreduced")
            client, created = self._connect(client, job_spec, job_id, job_token, timeout_s, admin_token)
        elif not isinstance(client, _mainstay.Client):
            raise TypeError("MainstayOptimizer: client must be a mainstay.Client or the coordinator's "
                            "\"host:port\", got %s" % type(client).__name__)
        self.client = client
        self.layout = client.layout
        # Transports that read device memory (nccl, cuda_ipc; docs/transports.md) take CUDA
        # gradients where they are; the others get a host copy.
        connections = client.connections()
        self._device_pushes = bool(connections) and all(c["transport"] in ("nccl", "cuda_ipc") for c in connections)
        self._check_job(named)
        self._build_buffers(named)
        self._next_step = 0
        self.version = None
        self.last_stats = None
        self.retried_steps = 0   # attempts at steps the daemons aborted, pushed again by step() or the client
        self.rewinds = 0         # restores (or failovers to an older step) that step() resumed from
        self.allgather_bytes = 0  # bytes this rank sent in the parameter all-gather of the last version loaded
        self._sync = True
        self._pusher = _Pusher(self)
        self._reset_step()
        if self._overlap:
            self._install_hooks()
        if resume:
            self.resync()
        else:
            pushed = None
            if self._rank == 0:
                try:
                    for b in self._buckets:  # every shard from rank 0: the ranks' models may differ
                        client.push_initial_params(b["index"], self._host(self._param_flat[b["index"]].float()),
                                                   all_shards=True)
                except Exception as e:  # noqa: BLE001 (the other ranks must not wait for version 0)
                    pushed = e
            self._load_agreed(0, failed_here=pushed)
        self.created_job = created  # True on the rank that created the job

    # ---- torch.optim.Optimizer surface.

    def add_param_group(self, param_group):
        if not self._initializing:
            raise ValueError("MainstayOptimizer: param groups are fixed when the job is created (each tensor's group "
                             "is part of the job); pass every group in params=")
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

    def zero_grad(self, set_to_none=False):
        """set_to_none=False: zeros the flat gradient buffers in place (the parameters' .grad stay
        views into them, so backward accumulates there with no copy). True: sets every .grad to
        None, as torch does; the next backward allocates new gradients, which are copied into the
        flat buffers when their bucket is reduced."""
        if set_to_none:
            for views in self._views:
                for p, _ in views:
                    p.grad = None
            return
        for flat in self._grad_flat:
            flat.zero_()
        self._alias_grads()

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside only accumulate gradients (no reduce-scatter, no push), as
        DDP's no_sync(): use it for every micro-batch of a gradient accumulation but the last."""
        before, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = before

    @torch.no_grad()
    def step(self, closure=None):
        """One optimizer step: the reduce-scatter and push of the buckets the backward hooks did
        not start, finish_step with every group's hyperparameters, then the new version pulled,
        all-gathered and dequantized into the parameters. Returns the closure's loss (if a
        closure was given); the StepStats dict is in ``last_stats``."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_groups()
        groups = [(float(g["lr"]), float(g["weight_decay"])) for g in self.param_groups[:self._num_groups]]
        step = self._next_step
        try:
            for i in range(len(self._buckets)):  # buckets no hook started, in bucket order
                if not self._launched[i]:
                    self._launch(i)
        except BaseException:
            self._reset_step()
            raise
        pushes, resume, stats = [], None, None
        for attempt in range(1, self.MAX_STEP_ATTEMPTS + 1):
            try:
                if attempt == 1:
                    self._pusher.drain()  # raises what starting a push raised on the pusher thread
                    pushes = [self._pushes[i] for i in range(len(self._buckets))]
                else:
                    pushes = [self._push(i, step) for i in range(len(self._buckets))]
                stats = self.client.finish_step(step, groups=groups, timeout_s=self._step_timeout_s)
                for h in pushes:
                    h.wait()
                if stats.get("attempts", 1) > 1:  # the client pushed the step again itself
                    self.retried_steps += stats["attempts"] - 1
                    print("mainstay.torch: step %d of job %s was aborted (%s); the client pushed it again "
                          "(%d attempts)" % (step, self.client.job_id, stats["first_abort"], stats["attempts"]),
                          file=sys.stderr, flush=True)
                break
            except _mainstay.Error as e:
                for h in pushes:  # settle every push of this attempt before the next one
                    try:
                        h.wait()
                    except _mainstay.Error:
                        pass
                if e.code != "ABORTED" or attempt == self.MAX_STEP_ATTEMPTS:
                    self._reset_step()
                    raise
                if self._resume_step(e, step) < step:
                    resume = (self._resume_step(e, step), e.message)  # the job was restored
                    break
                # The daemons gave this step up and changed nothing (a peer lost mid-step, a
                # daemon left the placement): push the same gradients again.
                self.retried_steps += 1
                print("mainstay.torch: step %d of job %s was aborted (%s); pushing it again (attempt %d)"
                      % (step, self.client.job_id, e.message, attempt + 1), file=sys.stderr, flush=True)
            except BaseException:
                self._reset_step()
                raise
        self._reset_step()
        self._next_step = step + 1
        self.last_stats = stats if resume is None else None
        committed = stats is not None and not stats["skipped"]
        self._load_after_step(step, stats["version"] if committed else None, resume)
        return loss

    @staticmethod
    def _resume_step(error, step):
        """The step an ABORTED tells this trainer to run next: the daemons' committed step + 1
        when they say (a restore rewinds it below `step`), else `step` itself."""
        info = error.info or {}
        committed = info.get("committed_step")
        if committed is None or committed + 1 > step:
            return step
        return committed + 1

    def _load_after_step(self, step, version, resume):
        """Every rank ends step() here, whatever its finish_step said, and the ranks agree on
        what to load: `version` (the step committed; None when it was skipped, or when the job
        was restored) into the parameters, or, when any rank's finish_step or pull says the job
        was restored (`resume`: (step to resume at, message)) or any rank's pull failed, the
        version every rank sees as the newest. One small all-reduce per step keeps the ranks'
        collectives in line: a rank whose pull fails (a daemon lost between the step's commit
        and its pull) would otherwise leave the others waiting in the all-gather."""
        pulled, failed, why = None, resume is not None, resume[1] if resume is not None else ""
        hint = resume[0] if resume is not None else -1
        if version is not None and not failed:
            try:
                pulled = self._pull_all(version)
            except Exception as e:  # noqa: BLE001 (told to every rank, then handled together)
                failed, why = True, "%s: %s" % (getattr(e, "code", type(e).__name__), getattr(e, "message", e))
                # Only the restore's refusal says where to resume (other errors carry the
                # committed step of a daemon that may hold nothing yet).
                if getattr(e, "code", None) == "ABORTED" and self._resume_step(e, step + 1) < step + 1:
                    hint = self._resume_step(e, step + 1)
        mine = -1 if version is None else version
        flags = self._max_over_ranks([int(failed), hint, mine, -mine])
        if not flags[0] and flags[2] == -flags[3]:  # no failure, one outcome on every rank
            if version is not None:
                self._gather(version, pulled)
            return
        # Some rank could not load the step's version (or was told the job was restored): every
        # rank loads the newest version they all see, and resumes at the restored step when a
        # rank was told it (else at the next step: if the job was restored meanwhile, that
        # step's finish_step says so, with the step to resume at).
        resume_at = flags[1] if flags[1] >= 0 else step + 1
        loaded = self._load_agreed()
        self._next_step = resume_at
        if resume_at <= step:
            self.rewinds += 1
            print("mainstay.torch: job %s was restored to step %d (%s); resuming there at version %d"
                  % (self.client.job_id, resume_at - 1, why or "seen by another rank", loaded),
                  file=sys.stderr, flush=True)
        else:
            print("mainstay.torch: version %s of job %s could not be loaded on every rank (%s); loaded version %d"
                  % (version, self.client.job_id, why or "failed on another rank", loaded), file=sys.stderr, flush=True)

    # The codes of a pull that no retry mends (a bad token, a bad request). (A daemon that lost
    # the job answers UNAVAILABLE, which the client retries until its deadline.)
    _FATAL_PULL_CODES = ("UNAUTHENTICATED", "PERMISSION_DENIED", "NOT_FOUND", "INVALID_ARGUMENT")

    def _load_agreed(self, version=None, failed_here=None):
        """Loads `version` (None: the newest version, once every rank sees the same one: a
        restore replaces the job's daemons one by one) into the parameters on every rank, or on
        none: a rank whose pull fails (a daemon lost meanwhile) tells the others, and all of them
        pull again (the client re-reads the placement) until every rank has it. A collective.
        Returns the version loaded. Raises RuntimeError (from the error this rank saw, if any)
        on every rank when the ranks do not get there within step_timeout, or at once when a
        rank's pull failed for good: a bad token or request, a fixed version no longer there
        (FAILED_PRECONDITION), an error that is not the client's, or `failed_here` (what this
        rank did before the load failed, e.g. rank 0's push of the initial parameters)."""
        deadline = time.monotonic() + self._step_timeout_s
        while True:
            v, pulled, error = -1 if version is None else version, None, failed_here
            if error is None:
                try:
                    if version is None:
                        v = self.client.pull_shard(self._buckets[0]["index"], self._rank, _mainstay.Client.LATEST,
                                                   timeout_s=self._step_timeout_s).version
                    pulled = self._pull_all(v)
                except Exception as e:  # noqa: BLE001 (told to every rank, then handled together)
                    error = e
            code = getattr(error, "code", None)
            fatal = error is not None and (error is failed_here or code is None or code in self._FATAL_PULL_CODES or
                                           (version is not None and code == "FAILED_PRECONDITION"))
            # Whether to give up is agreed too: the ranks' clocks started at different times.
            flags = self._max_over_ranks([int(pulled is None), int(fatal), int(time.monotonic() > deadline), v, -v])
            if not flags[0] and flags[3] == -flags[4]:
                self._gather(v, pulled)
                return v
            if flags[1] or flags[2]:
                what = "the newest version" if version is None else "version %d" % version
                raise RuntimeError("MainstayOptimizer: the ranks of job %s could not all load %s (%s; newest seen: "
                                   "%d..%d)%s" % (self.client.job_id, what,
                                                  "a rank failed for good" if flags[1]
                                                  else "not within %s s" % self._step_timeout_s,
                                                  -flags[4], flags[3],
                                                  "; here: %s" % error if error is not None else "")) from error
            time.sleep(0.2)

    def _max_over_ranks(self, values):
        """The elementwise MAX of `values` (ints) over the ranks (a collective)."""
        if self._world == 1:
            return list(values)
        t = self._to_comm(torch.tensor(values, dtype=torch.int64))
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self._group)
        return [int(x) for x in t.cpu()]

    def state_dict(self):
        """A Mainstay checkpoint of the job (admin CreateCheckpoint, wait=True) plus the
        param_groups' hyperparameters. Call it on one rank between steps; it needs no
        collective. Raises mainstay.Error (code FAILED_PRECONDITION) on a coordinator started
        without --checkpoint-dir."""
        info = self.client.create_checkpoint(wait=True, admin_token=self._admin_token)
        if info["state"] != "COMMITTED":
            raise RuntimeError("state_dict: checkpoint %s of job %s is %s, not COMMITTED: %s" % (
                info["checkpoint_id"], info["job_id"], info["state"], info["error"] or "no reason given"))
        groups, index = [], 0
        for g in self.param_groups:
            d = {k: v for k, v in g.items() if k != "params"}
            d["params"] = list(range(index, index + len(g["params"])))
            index += len(g["params"])
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
        have = [len(g["params"]) for g in self.param_groups]
        got = [len(g.get("params", [])) for g in groups]
        if have != got:
            raise ValueError("load_state_dict: this optimizer's param groups hold %s parameters, the state_dict's %s"
                             % (have, got))
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
        refreshed = None
        try:
            self.client.refresh_placement()  # every shard was reassigned
        except Exception as e:  # noqa: BLE001 (told to every rank by the load)
            refreshed = e
        for mine, saved in zip(self.param_groups, groups):
            for k, v in saved.items():
                if k != "params":
                    mine[k] = tuple(v) if k == "betas" else v
        self._next_step = int(ms["next_step"])
        self._reset_step()
        self._load_agreed(value, failed_here=refreshed)

    # ---- Faults.

    def resync(self):
        """Re-joins the group after a rank was restarted: every rank of the (re-initialized)
        group calls it at the same time (a restarted rank does so inside its constructor, with
        resume=True). Agrees on the next step, loads the newest version into the parameters,
        and leaves the gradients zeroed."""
        self._reset_step()
        version = self._load_agreed()  # (while a step is still being committed, the ranks wait for it)
        next_step = self._max_over_ranks([self._next_step])[0]
        self._next_step = max(next_step, version)  # step s makes version s + 1 unless skipped
        self.zero_grad()

    # ---- Param groups and the job.

    @staticmethod
    def _groups_of(params, trainable):
        """The param groups as torch.optim takes them: a list of dicts with a list in "params"."""
        if params is None:
            return [{"params": [p for _, p in trainable]}]
        if isinstance(params, torch.Tensor):
            raise TypeError("MainstayOptimizer: params must be an iterable of parameters or of param-group dicts "
                            "(as torch.optim.AdamW takes), got a single Tensor")
        params = list(params)
        if not params:
            raise ValueError("MainstayOptimizer: params is empty")
        dicts = [isinstance(x, dict) for x in params]
        if any(dicts) and not all(dicts):
            raise TypeError("MainstayOptimizer: params mixes parameters and param-group dicts; give one or the other")
        if not all(dicts):
            return [{"params": params}]
        groups = []
        for g, d in enumerate(params):
            if "params" not in d:
                raise ValueError("MainstayOptimizer: param group %d has no \"params\"" % g)
            ps = d["params"]
            groups.append(dict(d, params=[ps] if isinstance(ps, torch.Tensor) else list(ps)))
        return groups

    @staticmethod
    def _group_index(groups, trainable):
        """{id(parameter): group index} of the trainable parameters in the groups."""
        name_of = {id(p): n for n, p in trainable}
        group_of = {}
        for g, group in enumerate(groups):
            for p in group["params"]:
                if not isinstance(p, torch.Tensor):
                    raise TypeError("MainstayOptimizer: param group %d holds a %s, not a parameter" % (
                        g, type(p).__name__))
                if id(p) in group_of:
                    raise ValueError("MainstayOptimizer: parameter %s is in param groups %d and %d" % (
                        name_of.get(id(p), tuple(p.shape)), group_of[id(p)], g))
                if id(p) in name_of:
                    group_of[id(p)] = g
                elif p.requires_grad:
                    raise ValueError("MainstayOptimizer: param group %d holds a parameter of shape %s that is not a "
                                     "parameter of the model (model.named_parameters())" % (g, tuple(p.shape)))
        return group_of

    def _check_groups(self):
        """Each group's betas, eps and max_grad_norm must be the job's (the daemons apply one value
        to every tensor); a scheduler that changes them (OneCycleLR's cycle_momentum) is refused."""
        for g, group in enumerate(self.param_groups):
            for k in _JOB_KEYS:
                want, have = self.defaults[k], group.get(k, self.defaults[k])
                if (tuple(have) if k == "betas" else have) != want:
                    raise ValueError("MainstayOptimizer: param group %d has %s=%r, but the job applies %s=%r to every "
                                     "group (only lr and weight_decay may differ per group and per step; a scheduler "
                                     "that changes %s, such as OneCycleLR with cycle_momentum=True, is not supported)"
                                     % (g, k, have, k, want, k))

    @staticmethod
    def _check_params(named):
        device, dtype = named[0][1].device, named[0][1].dtype
        for name, p in named:
            if p.dtype not in (torch.float32, torch.bfloat16):
                raise TypeError("MainstayOptimizer: parameter %s is %s; keep the model's parameters in torch.float32 "
                                "or torch.bfloat16 (the daemons hold the FP32 masters and publish bf16/fp8/nvfp4 "
                                "weights; use autocast for lower-precision compute)" % (name, p.dtype))
            if p.dtype != dtype:
                raise TypeError("MainstayOptimizer: parameter %s is %s, %s is %s; give every parameter one dtype" % (
                    name, p.dtype, named[0][0], dtype))
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
    def _make_spec(named, group_of, recipe, optimizer, betas, eps, weight_decay, max_grad_norm, extra, unreduced):
        tensors = []
        for n, p in named:
            t = {"name": n, "shape": list(p.shape) if p.dim() > 0 else [1]}
            if group_of[n]:
                t["param_group"] = group_of[n]
            tensors.append(t)
        spec = {
            "name": "torch-%d-%d" % (os.getpid(), int(time.time() * 1000)),
            "recipe": recipe,
            "optimizer": {"type": optimizer, "beta1": float(betas[0]), "beta2": float(betas[1]), "eps": float(eps),
                          "weight_decay": float(weight_decay), "max_grad_norm": float(max_grad_norm)},
            "tensors": tensors,
        }
        if optimizer == "sgd":
            spec["optimizer"] = {"type": "sgd", "weight_decay": float(weight_decay), "max_grad_norm": float(max_grad_norm)}
        if unreduced:
            spec["unreduced_pushes"] = True
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
        job = {t["name"]: (tuple(t["shape"]), t["param_group"]) for t in self.layout.tensors}
        model = {n: (tuple(p.shape) if p.dim() > 0 else (1,), self._group_of_name[n]) for n, p in named}
        missing = sorted(set(model) - set(job))
        extra = sorted(set(job) - set(model))
        wrong = sorted(n for n in set(model) & set(job) if model[n][0] != job[n][0])
        regrouped = sorted(n for n in set(model) & set(job) if model[n][1] != job[n][1])
        if missing or extra or wrong or regrouped:
            parts = []
            if missing:
                parts.append("not in the job: %s" % ", ".join(missing[:5]))
            if extra:
                parts.append("in the job but not trainable in the model (or in no param group): %s" % ", ".join(extra[:5]))
            for n in wrong[:5]:
                parts.append("%s has shape %s in the model, %s in the job" % (n, model[n][0], job[n][0]))
            for n in regrouped[:5]:
                parts.append("%s is in param group %d here, %d in the job" % (n, model[n][1], job[n][1]))
            raise ValueError("MainstayOptimizer: the model's parameters do not match job %s (%s)" % (
                c.job_id, "; ".join(parts)))
        self._num_groups = self.layout.num_param_groups

    # ---- Buffers and hooks.

    def _build_buffers(self, named):
        layout = self.layout
        by_name = dict(named)
        self._buckets = layout.buckets
        self._param_flat, self._grad_flat, self._views, self._shard = [], [], [], []
        for b in self._buckets:
            n, sn, d = b["numel"], b["shard_numel"], self._world
            for r in range(d):
                if tuple(layout.shard_range(b["index"], r)) != (r * sn, (r + 1) * sn):
                    raise RuntimeError("MainstayOptimizer: bucket %d shard %d is not [r * shard_numel, (r+1) * "
                                       "shard_numel)" % (b["index"], r))
            pflat = torch.zeros(n, dtype=self._dtype, device=self._device)
            gflat = torch.zeros(n, dtype=self._dtype, device=self._device)
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
            self._views.append(views)
            self._shard.append((self._rank * sn, (self._rank + 1) * sn))
        self._max_numel = max(b["numel"] for b in self._buckets)
        self._scratch = None  # FP32, the largest bucket: dequantized values of bf16 parameters
        self._alias_grads()

    def __del__(self):
        for h in getattr(self, "_hook_handles", ()):
            h.remove()

    def _install_hooks(self):
        """A hook per parameter that runs once its gradient is accumulated; the bucket's last
        one starts the bucket (PyTorch >= 2.1: post-accumulate-grad hooks; before: a hook on
        the parameter's AccumulateGrad node, as DDP does)."""
        self._hook_handles, self._grad_accs = [], []
        me = weakref.ref(self)  # the model keeps its hooks: they must not keep the optimizer alive
        for i, views in enumerate(self._views):
            for p, _ in views:
                def ready(*_, i=i):
                    opt = me()
                    if opt is not None:
                        opt._grad_ready(i)
                if hasattr(p, "register_post_accumulate_grad_hook"):
                    self._hook_handles.append(p.register_post_accumulate_grad_hook(ready))
                else:
                    with torch.enable_grad():
                        acc = p.expand_as(p).grad_fn.next_functions[0][0]
                    self._hook_handles.append(acc.register_hook(ready))
                    self._grad_accs.append(acc)  # the node must outlive its hook

    def _grad_ready(self, i):
        if not self._sync:
            return
        if self._launched[i]:
            raise RuntimeError("mainstay.torch: a gradient of bucket %d was accumulated again after the bucket was "
                               "reduced for step %d; wrap every backward of a gradient accumulation but the last in "
                               "opt.no_sync(), or call step() (and zero_grad()) between backward passes"
                               % (i, self._next_step))
        self._ready[i] += 1
        if self._ready[i] == len(self._views[i]):
            self._launch(i)

    def _reset_step(self):
        """Forgets the current step's launched buckets (after a step, or a failed one)."""
        self._pusher.abandon()
        n = len(self._buckets)
        self._ready = [0] * n
        self._launched = [False] * n
        self._payloads = [None] * n
        self._pushes = [None] * n

    def _alias_grads(self):
        for views in self._views:
            for p, gv in views:
                if p.grad is None or p.grad.data_ptr() != gv.data_ptr():
                    p.grad = gv

    def _collect_grads(self, i):
        # Backward accumulates into the .grad views in place; a .grad replaced by user code
        # (zero_grad(set_to_none=True), manual assignment) is copied in, a missing one is 0.
        for p, gv in self._views[i]:
            g = p.grad
            if g is None:
                gv.zero_()
            elif g.data_ptr() != gv.data_ptr():
                gv.copy_(g)

    # ---- Gradients out.

    def _launch(self, i):
        """Starts bucket i of this step: its gradients gathered into the flat buffer, then (reduced
        mode) the reduce-scatter started and handed to the pusher, or (unreduced mode) pushed."""
        self._launched[i] = True
        self._collect_grads(i)
        if self._reduce == "unreduced" or self._world == 1:
            self._pusher.submit(i, None, None)
            return
        lo, hi = self._shard[i]
        flat = self._grad_flat[i]
        if self._backend() == "nccl":
            # In place, as Megatron's distributed optimizer does: the reduced shard lands in this
            # rank's slice of the flat gradient buffer.
            work = dist.reduce_scatter_tensor(flat[lo:hi], flat, op=dist.ReduceOp.SUM, group=self._group,
                                              async_op=True)
            self._pusher.submit(i, work, None)
            return
        # Gloo has no reduce-scatter: an all-to-all gives every rank the D copies of its own
        # shard, which the pusher sums in rank order (deterministic). Gloo moves no bf16 (nor
        # int16); the all-to-all only moves bytes, so those go as uint8. Every bucket's buffer has
        # the largest bucket's size, so that the pusher reuses them.
        buf = self._pusher.buffer(self._max_numel, flat.dtype, flat.device)
        raw = (lambda t: t.view(torch.uint8)) if flat.dtype == torch.bfloat16 else (lambda t: t)
        try:
            work = dist.all_to_all_single(raw(buf[:flat.numel()]), raw(flat), group=self._group, async_op=True)
        except BaseException:
            self._pusher.release(buf)
            raise
        self._pusher.submit(i, work, buf)

    def _prepare_payload(self, i, buf):
        """Once bucket i's collective is done: the reduced (and averaged) shard written into this
        rank's slice of the flat gradient buffer, where it stays until zero_grad() (a push does
        not copy its data, and an aborted step pushes it again). Unreduced mode: the whole flat
        gradient. The other ranks' slices of the buffer keep this rank's own gradients."""
        flat = self._grad_flat[i]
        if self._reduce == "unreduced":
            self._payloads[i] = self._wire(flat)
            return
        lo, hi = self._shard[i]
        shard = flat[lo:hi]
        if buf is not None:  # gloo: the sum over ranks in FP32, in rank order, rounded once
            total = buf[:flat.numel()].view(self._world, hi - lo).sum(dim=0, dtype=torch.float32)
            if self._average:
                total /= self._world
            shard.copy_(total)
        elif self._world > 1 and self._average:  # nccl: summed in place
            shard.div_(self._world)
        self._payloads[i] = self._wire(shard)

    def _push(self, i, step):
        b = self._buckets[i]["index"]
        payload = self._payloads[i]
        if self._reduce == "unreduced":
            # The daemons sum the D ranks' contributions in FP32 and divide by the loss scale.
            scale = float(self._world) if self._average else 0.0
            return self.client.push_bucket_unreduced(b, step, payload, wait=False, loss_scale=scale)
        return self.client.push_grad(b, step, payload, wait=False)

    def _wire(self, t):
        """`t` as the client takes it (float32, or bf16 bits as int16): a CUDA tensor as it is
        where the transport reads device memory (by its __cuda_array_interface__, whose stream the
        push waits for), else a host numpy view."""
        if t.dtype == torch.bfloat16:
            t = t.view(torch.int16)
        if self._device_pushes and t.device.type == "cuda":
            return t.contiguous()
        return self._host(t)

    def _host(self, t):
        """A numpy view of `t` (CPU) or of a host copy of it (device tensors)."""
        if t.device.type == "cpu":
            return t.contiguous().numpy()
        return t.detach().to("cpu").numpy()

    # ---- Parameters in.

    def _pull_all(self, version):
        """This rank's shard of every bucket at `version`, pulled concurrently. Raises
        mainstay.Error (after every pull has ended) when one fails."""
        handles = [self.client.pull_shard(b["index"], self._rank, version, wait=False, timeout_s=self._step_timeout_s)
                   for b in self._buckets]
        pulled, error = [], None
        for h in handles:
            try:
                pulled.append(h.wait())
            except _mainstay.Error as e:
                error = error or e
        if error is not None:
            raise error
        for p in pulled:
            if p.unchanged:
                raise RuntimeError("MainstayOptimizer: version %d of job %s is unchanged (a skipped step) but the "
                                   "step said it was committed" % (version, self.client.job_id))
        return pulled

    def _gather(self, version, pulled):
        """All-gathers the pulled shards of every bucket among the ranks into the flat parameter
        buffers, up to MAX_IN_FLIGHT buckets at a time (a collective)."""
        in_flight, sent = [], 0
        for b, shard in zip(self._buckets, pulled):
            i = b["index"]
            if self._world == 1:
                self._dequantize_into(i, shard, self._param_flat[i])
                continue
            if len(in_flight) >= self.MAX_IN_FLIGHT:
                self._finish_gather(*in_flight.pop(0))
            if self._allgather == "quantized":
                record = torch.from_numpy(shard.shard_record())
                recv = torch.empty(self._world * record.numel(), dtype=torch.uint8)
                record, recv = self._to_comm(record), self._to_comm(recv)
                sent += record.numel()
            else:
                lo, hi = self._shard[i]
                self._dequantize_into(i, shard, self._param_flat[i][lo:hi])
                record = self._to_comm(self._param_flat[i][lo:hi].float())
                recv = self._to_comm(torch.empty(self._world * (hi - lo), dtype=torch.float32))
                sent += record.numel() * 4
            if self._backend() == "nccl":
                work = dist.all_gather_into_tensor(recv, record, group=self._group, async_op=True)
            else:
                work = dist.all_gather(list(recv.view(self._world, -1).unbind(0)), record, group=self._group,
                                       async_op=True)
            in_flight.append((i, work, record, recv))
        for item in in_flight:
            self._finish_gather(*item)
        self.allgather_bytes = sent
        self.version = version

    def _finish_gather(self, i, work, record, recv):
        work.wait()
        del record
        recv = recv.cpu()
        if self._allgather == "quantized":
            whole = _mainstay.PulledBucket.from_shard_records(self.layout, self._buckets[i]["index"], recv.numpy())
            self._dequantize_into(i, whole, self._param_flat[i])
        else:
            self._param_flat[i].copy_(recv)

    def _dequantize_into(self, i, pulled, out):
        """The FP32 values of what `pulled` covers, written into `out` (a slice of a flat
        parameter buffer): in place for FP32 host parameters, else through the FP32 scratch."""
        if out.dtype == torch.float32 and out.device.type == "cpu":
            pulled.dequantize_covered(out=out.numpy())
            return
        if self._scratch is None:
            self._scratch = torch.empty(self._max_numel, dtype=torch.float32)
        scratch = self._scratch[:out.numel()]
        pulled.dequantize_covered(out=scratch.numpy())
        out.copy_(scratch)


class _Pusher:
    """The background thread that turns started buckets into pushes: it waits for a bucket's
    collective, reduces its shard and pushes it (asynchronously), in the order the buckets
    were started, while backward goes on. Holds at most MAX_IN_FLIGHT collective buffers."""

    def __init__(self, opt):
        # A weak reference: the thread must not keep its optimizer (and the model's buffers)
        # alive; it ends once the optimizer is gone.
        self._opt = weakref.ref(opt)
        self._queue = queue.Queue()
        self._free = []                     # collective buffers to reuse
        self._slots = threading.Semaphore(opt.MAX_IN_FLIGHT)
        self._pending = 0
        self._done = threading.Condition()
        self._error = None
        self._thread = None

    def buffer(self, numel, dtype, device):
        self._slots.acquire()  # waits for the oldest bucket in flight to be pushed
        with self._done:
            for k, buf in enumerate(self._free):
                if buf.numel() >= numel and buf.dtype == dtype and buf.device == device:
                    return self._free.pop(k)
        return torch.empty(numel, dtype=dtype, device=device)

    def release(self, buf):
        with self._done:
            self._free.append(buf)
        self._slots.release()

    def submit(self, i, work, buf):
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="mainstay-pusher", daemon=True)
            self._thread.start()
        with self._done:
            self._pending += 1
        self._queue.put((i, work, buf, self._opt()._next_step))

    def drain(self):
        """Waits until every submitted bucket is pushed; raises what the thread raised."""
        with self._done:
            self._done.wait_for(lambda: self._pending == 0)
            error, self._error = self._error, None
        if error is not None:
            raise error

    def abandon(self):
        """Lets the submitted buckets finish and forgets their error (a step given up)."""
        with self._done:
            self._done.wait_for(lambda: self._pending == 0)
            self._error = None

    def _run(self):
        while True:
            try:
                i, work, buf, step = self._queue.get(timeout=5.0)
            except queue.Empty:
                if self._opt() is None:
                    return
                continue
            opt = self._opt()
            try:
                with torch.no_grad():
                    if work is not None:
                        work.wait()
                    opt._prepare_payload(i, buf)
                    opt._pushes[i] = opt._push(i, step)
            except BaseException as e:  # raised by step() through drain()
                with self._done:
                    if self._error is None:
                        self._error = e
            finally:
                if buf is not None:
                    self.release(buf)
                with self._done:
                    self._pending -= 1
                    self._done.notify_all()
                del opt
