#include "server/coordinator/coordinator.h"

#include "server/coordinator/coordinator_impl.h"

namespace mainstay::coordinator {
Coordinator::Coordinator(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Coordinator::~Coordinator() {
  if (impl_->options.assigner != nullptr) impl_->options.assigner->SetRefusedHandler(nullptr);  // waits for a call in it
  std::vector<Impl::Background> threads;
  {
    absl::MutexLock lock(&impl_->mu);
    impl_->stopping = true;
    threads.swap(impl_->checkpoint_threads);
  }
  for (Impl::Background& b : threads) b.thread.join();  // background checkpoints end at their daemons' answers
}

void Coordinator::SetChangeListener(std::function<void()> listener) {
  absl::MutexLock lock(&impl_->listener_mu);
  impl_->listener = std::move(listener);
}

bool Coordinator::StateLockFreeForTesting() const {
  if (!impl_->mu.TryLock()) return false;
  impl_->mu.Unlock();
  return true;
}

size_t Coordinator::background_threads_for_testing() const {
  absl::MutexLock lock(&impl_->mu);
  return impl_->checkpoint_threads.size();
}

absl::StatusOr<std::unique_ptr<Coordinator>> Coordinator::Create(const CoordinatorOptions& options) {
  if (options.store == nullptr) return absl::InvalidArgumentError("options.store: required");
  if (options.clock == nullptr) return absl::InvalidArgumentError("options.clock: required");
  if (options.default_lease_ttl_ms < options.min_lease_ttl_ms || options.default_lease_ttl_ms > options.max_lease_ttl_ms) {
    return absl::InvalidArgumentError(absl::StrCat("lease_ttl_ms: must be in [", options.min_lease_ttl_ms, ", ",
                                                   options.max_lease_ttl_ms, "], got ", options.default_lease_ttl_ms));
  }
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  if (options.assigner != nullptr) {
    // Assignments leave only once the state they follow is durable (Impl::AwaitDurable).
    impl->delivery = options.assigner;
    impl->held_assigner = std::make_unique<Impl::HeldAssigner>(impl.get());
    impl->options.assigner = impl->held_assigner.get();
  }
  MAINSTAY_ASSIGN_OR_RETURN(v1::CoordinatorState loaded, options.store->Load());
  absl::MutexLock lock(&impl->mu);
  impl->state = State::FromProto(loaded);
  impl->kv_history_floor = impl->state.counters.kv_revision();
  impl->written_seq.store(impl->state.sequence);
  {
    absl::MutexLock synced(&impl->sync_mu);
    impl->synced_seq = impl->state.sequence;
  }
  const int64_t now = impl->Mono();
  for (const auto& [id, d] : impl->state.daemons) {
    if (d.state() != v1::DAEMON_STATE_DOWN) impl->leases[id] = {"", options.default_lease_ttl_ms, now + options.default_lease_ttl_ms, 0, {}};
    // A daemon saved DOWN may have jobs the previous process had not failed over or restored
    // yet (the queue of jobs to recover is not saved): queue them again. Jobs already recovered
    // no longer name it.
    if (d.state() == v1::DAEMON_STATE_DOWN) impl->MarkJobsToRecover(id);
  }
  Log(LogLevel::kInfo, "coordinator",
      absl::StrCat("state loaded: sequence ", impl->state.sequence, ", ", impl->state.daemons.size(), " daemon(s), ",
                   impl->state.jobs.size(), " job(s), ", impl->state.kv.size(), " key(s)"));
  std::unique_ptr<Coordinator> coordinator(new Coordinator(std::move(impl)));
  if (options.assigner != nullptr) {
    options.assigner->SetRefusedHandler(
        [c = coordinator.get()](const std::string& address, const v1::AssignShardRequest& request,
                                const absl::Status& status) { c->AssignmentRefused(address, request, status); });
  }
  return coordinator;
}

void Coordinator::Tick() {
  {
    Impl::StateLock lock(*impl_);
    impl_->TickLocked();
  }
  impl_->RecoverJobs();
  impl_->RunCheckpointPolicy();
}

// ---- Membership.

absl::StatusOr<v1::RegisterDaemonResponse> Coordinator::RegisterDaemon(const v1::RegisterDaemonRequest& request) {
  if (request.address().empty() || request.address().find(':') == std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat("address: must be host:port, got '", request.address(), "'"));
  }
  if (request.requested_lease_ttl_ms() < 0) {
    return absl::InvalidArgumentError(absl::StrCat("requested_lease_ttl_ms: must be >= 0, got ", request.requested_lease_ttl_ms()));
  }
  if (request.resources().host_memory_bytes() < 0 || request.resources().device_memory_bytes() < 0) {
    return absl::InvalidArgumentError("resources: memory sizes must be >= 0");
  }
  Impl& s = *impl_;
  Impl::StateLock lock(s);
  s.TickLocked();
  const CoordinatorOptions& o = s.options;
  const int64_t ttl = request.requested_lease_ttl_ms() == 0
                          ? o.default_lease_ttl_ms
                          : std::clamp(request.requested_lease_ttl_ms(), o.min_lease_ttl_ms, o.max_lease_ttl_ms);
  v1::StateCounters counters = s.state.counters;
  std::string id = request.daemon_id();
  v1::DaemonInfo info;
  auto it = id.empty() ? s.state.daemons.end() : s.state.daemons.find(id);
  // The id's key: issued at its first registration, proved at every later one. Only its digest
  // is kept (and persisted, so that a coordinator restart keeps the binding).
  std::string key;
  if (it != s.state.daemons.end()) {
    const std::string& stored = it->second.key_sha256();
    const std::string presented = Sha256(request.daemon_key());
    if (!stored.empty() &&
        (request.daemon_key().empty() || CRYPTO_memcmp(stored.data(), presented.data(), presented.size()) != 0)) {
      return absl::PermissionDeniedError(absl::StrCat(
          "daemon id '", id, "' belongs to the daemon process it was issued to, and this registration ",
          request.daemon_key().empty() ? "presents no daemon key" : "presents a wrong daemon key",
          " (a restarted daemon registers with an empty id and gets a new one)"));
    }
    info = it->second;  // the same process again (a lost lease, a coordinator restart): placements kept
    key = request.daemon_key();
  } else if (id.empty()) {
    counters.set_next_daemon(counters.next_daemon() + 1);
    id = absl::StrCat("daemon-", counters.next_daemon());
  }
  // One live daemon per address: calls for the daemon on record there (AssignShard, DropShard
  // of a job it should not hold) must never reach another one.
  for (const auto& [other_id, other] : s.state.daemons) {
    if (other_id == id || other.endpoint().address() != request.address()) continue;
    if (other.state() != v1::DAEMON_STATE_DOWN && s.leases.count(other_id)) {
      return absl::AlreadyExistsError(absl::StrCat(
          "address ", request.address(), " is daemon ", other_id,
          "'s, whose lease is live: a daemon restarted on the same address can register once that lease runs out"));
    }
  }
  if (key.empty()) key = RandomHex(32);
  info.set_key_sha256(Sha256(key));
  v1::DaemonEndpoint* e = info.mutable_endpoint();
  e->set_daemon_id(id);
  e->set_address(request.address());
  e->set_node_name(request.node_name().empty() ? request.address().substr(0, request.address().rfind(':'))
                                               : request.node_name());
  e->clear_transports();
  bool has_grpc = false;
  for (int t : request.transports()) {
    e->add_transports(static_cast<v1::Transport>(t));
    has_grpc |= t == v1::TRANSPORT_GRPC;
  }
  if (!has_grpc) e->add_transports(v1::TRANSPORT_GRPC);
  e->set_ucx_worker_address(request.ucx_worker_address());
  e->set_takes_crc32c_trailer(request.takes_crc32c_trailer());
  *info.mutable_resources() = request.resources();
  info.set_version(request.version());
  *info.mutable_labels() = request.labels();
  // An admin's cordon or drain survives restarts; a DOWN daemon comes back READY.
  if (info.state() == v1::DAEMON_STATE_UNSPECIFIED || info.state() == v1::DAEMON_STATE_DOWN) {
    info.set_state(v1::DAEMON_STATE_READY);
  }
  const int64_t now = s.Now();
  info.set_registered_unix_ms(now);
  Batch batch;
  batch.PutDaemon(info);
  s.AddJobHealth(batch);
  MAINSTAY_RETURN_IF_ERROR(s.Commit(batch, counters));
  Impl::Lease& lease = s.leases[id];
  lease = {RandomHex(16), ttl, s.Mono() + ttl, 0, {}};
  Log(LogLevel::kInfo, "coordinator", absl::StrCat("daemon ", id, " registered at ", request.address(), " (node ",
                                                   e->node_name(), ", lease ", ttl, " ms)"));
  v1::RegisterDaemonResponse response;
  response.set_daemon_id(id);
  response.set_lease_id(lease.id);
  response.set_daemon_key(key);
  response.set_lease_ttl_ms(ttl);
  response.set_heartbeat_interval_ms(std::max<int64_t>(ttl / 3, 1));
  response.set_coordinator_id(o.coordinator_id);
  response.set_checkpoint_dir(o.checkpoint_dir);
  return response;
}

absl::StatusOr<v1::HeartbeatResponse> Coordinator::Heartbeat(const v1::HeartbeatRequest& request) {
  Impl& s = *impl_;
  Impl::StateLock lock(s, /*wait_durable=*/false);
  // Renew first: a heartbeat that waited for the lock must not see its own lease expire in the
  // tick below.
  if (auto l = s.leases.find(request.daemon_id()); l != s.leases.end() && l->second.id == request.lease_id()) {
    l->second.expires_ms = s.Mono() + l->second.ttl_ms;
  }
  s.TickLocked();
  auto d = s.state.daemons.find(request.daemon_id());
  auto l = s.leases.find(request.daemon_id());
  if (d == s.state.daemons.end() || l == s.leases.end() || d->second.state() == v1::DAEMON_STATE_DOWN ||
      l->second.id != request.lease_id()) {
    return absl::NotFoundError(absl::StrCat("no live lease ", request.lease_id(), " for daemon '", request.daemon_id(),
                                            "': register again"));
  }
  l->second.used_bytes = request.used_bytes();
  l->second.connections.assign(request.connections().begin(), request.connections().end());
  for (const v1::JobProgress& p : request.jobs()) {
    // A daemon that still holds a job it is no longer placed on (it came back after its shards
    // were restored elsewhere, or missed a DropShard) is told to drop it; its progress is stale
    // and must not steer checkpoints or `jobs show`.
    auto job = s.state.jobs.find(p.job_id());
    bool placed = false, moving_out = false;
    if (job != s.state.jobs.end()) {
      for (const v1::DaemonEndpoint& e : job->second.placement().daemons()) placed |= e.daemon_id() == request.daemon_id();
      for (const v1::PendingMove& m : job->second.moves()) moving_out |= m.source_daemon_id() == request.daemon_id();
    }
    if (placed) {
      v1::JobProgress& kept = s.progress[p.job_id()][request.daemon_id()];
      if (!p.load_error().empty() && p.load_error() != kept.load_error()) {
        Log(LogLevel::kWarning, "coordinator",
            absl::StrCat("job ", p.job_id(), ": daemon ", request.daemon_id(),
                         " cannot load its state yet: ", p.load_error()));
      }
      kept = p;
      // A move's target that cannot allocate the copy would retry for ever with its source
      // fenced: the move goes elsewhere, as when a target refuses the assignment.
      const bool moving_in =
          std::any_of(job->second.moves().begin(), job->second.moves().end(),
                      [&](const v1::PendingMove& m) { return m.target_daemon_id() == request.daemon_id(); });
      if (moving_in && p.loading() && p.placement_epoch() == job->second.placement().epoch() &&
          p.load_error_code() == static_cast<int32_t>(absl::StatusCode::kResourceExhausted)) {
        s.PlaceRefusedRanks(request.daemon_id(), job->second, /*restore=*/false,
                            absl::ResourceExhaustedError(p.load_error()), /*moves_only=*/true);
      }
      continue;
    }
    if (moving_out) continue;  // it keeps the job until the move's target has copied it
    const int64_t epoch = job != s.state.jobs.end() ? job->second.placement().epoch() : p.placement_epoch() + 1;
    if (s.options.assigner != nullptr && p.placement_epoch() < epoch) {
      v1::DropShardRequest drop;
      drop.set_job_id(p.job_id());
      drop.set_placement_epoch(epoch);
      s.options.assigner->Drop(d->second.endpoint().address(), drop);
      Log(LogLevel::kInfo, "coordinator",
          absl::StrCat("daemon ", request.daemon_id(), " still holds job ", p.job_id(), " at epoch ",
                       p.placement_epoch(), " but is not in its placement (epoch ", epoch, "): dropping it there"));
    }
  }
  s.ReconcileLocked(request);
  v1::HeartbeatResponse response;
  response.set_lease_ttl_ms(l->second.ttl_ms);
  response.set_state(d->second.state());
  int64_t max_epoch = 0;
  for (const auto& [id, job] : s.state.jobs) {
    for (const v1::DaemonEndpoint& e : job.placement().daemons()) {
      if (e.daemon_id() == request.daemon_id()) max_epoch = std::max(max_epoch, job.placement().epoch());
    }
  }
  response.set_max_placement_epoch(max_epoch);
  return response;
}

void Coordinator::Impl::ReconcileLocked(const v1::HeartbeatRequest& request) {
  const std::string& daemon_id = request.daemon_id();
  const int64_t now = Now();
  std::map<std::string, const v1::JobProgress*> held;
  for (const v1::JobProgress& p : request.jobs()) held[p.job_id()] = &p;
  Batch batch;
  std::vector<std::pair<std::string, v1::DropShardRequest>> drops;  // sent once the batch is saved
  bool health_changed = false;
  for (const auto& [job_id, job] : state.jobs) {
    bool placed = false;
    for (const v1::DaemonEndpoint& e : job.placement().daemons()) placed |= e.daemon_id() == daemon_id;
    if (!placed) continue;
    const std::pair<std::string, std::string> key{job_id, daemon_id};
    auto h = held.find(job_id);
    if (!job.started() && h != held.end() && h->second->version() >= 0) {
      v1::StoredJob started = job;
      started.set_started(true);
      batch.PutJob(started);
    }
    if (h != held.end() && h->second->placement_epoch() >= job.placement().epoch()) {
      resends.erase(key);
      FinishMovesLocked(job, daemon_id, *h->second, batch, drops);
      continue;
    }
    if (jobs_to_recover.count(job_id)) continue;  // the restore sends assignments of its own
    Resend& r = resends[key];
    if (r.since_ms == 0) r.since_ms = now;  // an assignment may still be on its way: wait a little
    if (now - r.since_ms < options.reconcile_after_ms || now - r.last_ms < options.reconcile_after_ms) continue;
    r.last_ms = now;
    const bool moving_in = std::any_of(job.moves().begin(), job.moves().end(),
                                       [&](const v1::PendingMove& m) { return m.target_daemon_id() == daemon_id; });
    if (h == held.end() && job.started() && !moving_in) {
      // The job's state lives only in its daemons, and this one no longer has it (it restarted
      // within its lease). Re-sending the assignment would give it empty shards; recover the job
      // as if the daemon had died, once.
      if (lost_state[job_id].insert(daemon_id).second) {
        health_changed = true;
        Log(LogLevel::kWarning, "coordinator",
            absl::StrCat("daemon ", daemon_id, " is placed on job ", job_id,
                         " but no longer holds it (restarted?): its shards' state is lost; the job is DEGRADED "
                         "and will be restored from its newest checkpoint"));
        jobs_to_recover.insert(job_id);
      }
      continue;
    }
    const int64_t reported = h == held.end() ? -1 : h->second->placement_epoch();
    const v1::SourceCheckpoint* source =
        job.has_restored_from() && reported < job.restored_epoch() ? &job.restored_from() : nullptr;
    Log(LogLevel::kInfo, "coordinator",
        absl::StrCat("daemon ", daemon_id, " reports job ", job_id,
                     reported < 0 ? std::string(" not at all") : absl::StrCat(" at placement epoch ", reported),
                     " for ", now - r.since_ms, " ms; re-sending its assignment at epoch ", job.placement().epoch(),
                     source != nullptr ? absl::StrCat(" (the restore from ", source->checkpoint_id(), ")") : ""));
    SendAssignmentTo(job, daemon_id, source);  // a move's target: its moved ranks from their sources
  }
  // (AddJobHealth copies the whole state: only when something here can change a job's health.)
  if (batch.empty() && !health_changed) return;
  AddJobHealth(batch);
  if (batch.empty()) return;
  if (absl::Status saved = Commit(batch); !saved.ok()) {
    Log(LogLevel::kError, "coordinator", absl::StrCat("reconciliation not saved: ", saved.message()));
    return;
  }
  // After the batch that ends the moves: the outbox sends them once it is durable.
  for (const auto& [address, drop] : drops) options.assigner->Drop(address, drop);
}

void Coordinator::Impl::FinishMovesLocked(const v1::StoredJob& job, const std::string& daemon_id,
                                          const v1::JobProgress& progress, Batch& batch,
                                          std::vector<std::pair<std::string, v1::DropShardRequest>>& drops) {
  if (progress.loading() || job.moves().empty()) return;
  v1::StoredJob updated = job;
  updated.clear_moves();
  bool finished = false;
  for (const v1::PendingMove& m : job.moves()) {
    if (m.target_daemon_id() != daemon_id || progress.placement_epoch() < m.epoch()) {
      *updated.add_moves() = m;
      continue;
    }
    // The target holds the rank's state now: the source's copy can go, unless the source still
    // holds the rank (re-replication copied it to one more daemon).
    finished = true;
    const std::vector<std::string> holders = HoldersByRank(job).at(static_cast<size_t>(m.rank()));
    const bool kept = std::count(holders.begin(), holders.end(), m.source_daemon_id()) > 0;
    Log(LogLevel::kInfo, "coordinator",
        absl::StrCat("job ", job.info().job_id(), ": rank ", m.rank(), kept ? " copied from " : " moved from ",
                     m.source_daemon_id(), " to ", daemon_id, " (epoch ", m.epoch(), ")",
                     kept ? absl::StrCat("; the rank has ", holders.size(), " copies again")
                          : absl::StrCat("; dropping it on ", m.source_daemon_id())));
    auto source = state.daemons.find(m.source_daemon_id());
    if (kept || options.assigner == nullptr || source == state.daemons.end() ||
        source->second.state() == v1::DAEMON_STATE_DOWN) {
      continue;
    }
    v1::DropShardRequest drop;
    drop.set_job_id(job.info().job_id());
    drop.set_placement_epoch(job.placement().epoch());
    bool still_placed = false;
    for (const v1::DaemonEndpoint& e : job.placement().daemons()) still_placed |= e.daemon_id() == m.source_daemon_id();
    // A source that left the placement may still be the source of another rank's move (a drain
    // moves every rank it holds, each to its own target, each finishing on its own): it must
    // keep that rank until its target has it. It drops the whole job only with the last one
    // (or, with every move done at once, at its next heartbeat: no longer placed).
    for (const v1::PendingMove& other : job.moves()) {
      still_placed |= &other != &m && other.source_daemon_id() == m.source_daemon_id();
    }
    if (still_placed) {  // only the moved rank's shards; an empty list would drop the whole job
      for (int b = 0; b < job.layout().buckets_size(); ++b) {
        v1::ShardRef* ref = drop.add_shards();
        ref->set_bucket(b);
        ref->set_shard(m.rank());
      }
    }
    drops.emplace_back(source->second.endpoint().address(), std::move(drop));
  }
  if (finished) batch.PutJob(updated);
}

absl::Status Coordinator::DeregisterDaemon(const v1::DeregisterDaemonRequest& request) {
  Impl& s = *impl_;
  Impl::StateLock lock(s);
  auto d = s.state.daemons.find(request.daemon_id());
  auto l = s.leases.find(request.daemon_id());
  if (d == s.state.daemons.end() || l == s.leases.end() || l->second.id != request.lease_id()) {
    return absl::NotFoundError(absl::StrCat("no live lease ", request.lease_id(), " for daemon '", request.daemon_id(), "'"));
  }
  v1::DaemonInfo down = d->second;
  down.set_state(v1::DAEMON_STATE_DOWN);
  Batch batch;
  batch.PutDaemon(down);
  s.AddJobHealth(batch);
  MAINSTAY_RETURN_IF_ERROR(s.Commit(batch));
  s.leases.erase(request.daemon_id());
  s.MarkJobsToRecover(request.daemon_id());  // a stopped daemon's jobs are restored like a lost one's
  return absl::OkStatus();
}

v1::ListDaemonsResponse Coordinator::ListDaemons(const v1::ListDaemonsRequest& request) {
  Impl& s = *impl_;
  Impl::StateLock lock(s);
  s.TickLocked();
  v1::ListDaemonsResponse response;
  for (const auto& [id, d] : s.state.daemons) {
    if (d.state() == v1::DAEMON_STATE_DOWN && !request.include_down()) continue;
    *response.add_daemons() = s.Decorated(d);
  }
  return response;
}

absl::StatusOr<v1::CordonDaemonResponse> Coordinator::CordonDaemon(const v1::CordonDaemonRequest& request) {
  Impl& s = *impl_;
  Impl::StateLock lock(s);
  s.TickLocked();
  auto d = s.state.daemons.find(request.daemon_id());
  if (d == s.state.daemons.end()) return absl::NotFoundError(absl::StrCat("no daemon '", request.daemon_id(), "'"));
  if (d->second.state() == v1::DAEMON_STATE_DOWN) {
    return absl::FailedPreconditionError(absl::StrCat("daemon '", request.daemon_id(), "' is down"));
  }
  v1::DaemonInfo info = d->second;
  info.set_state(request.uncordon() ? v1::DAEMON_STATE_READY : v1::DAEMON_STATE_CORDONED);
  Batch batch;
  batch.PutDaemon(info);
  MAINSTAY_RETURN_IF_ERROR(s.Commit(batch));
  v1::CordonDaemonResponse response;
  *response.mutable_daemon() = s.Decorated(info);
  return response;
}

absl::StatusOr<v1::DrainDaemonResponse> Coordinator::DrainDaemon(const v1::DrainDaemonRequest& request) {
  Impl& s = *impl_;
  Impl::StateLock lock(s);
  s.TickLocked();
  auto d = s.state.daemons.find(request.daemon_id());
  if (d == s.state.daemons.end()) return absl::NotFoundError(absl::StrCat("no daemon '", request.daemon_id(), "'"));
  const std::string from = request.daemon_id();
  v1::DaemonInfo draining = d->second;
  draining.set_state(v1::DAEMON_STATE_DRAINING);
  Batch batch;
  batch.PutDaemon(draining);
  v1::DrainDaemonResponse response;
  std::vector<DaemonCandidate> candidates = s.Candidates(from);
  std::vector<v1::StoredJob> moved;
  for (const auto& [job_id, job] : s.state.jobs) {
    // Every rank this daemon holds a copy of (primary or replica) goes to a ready daemon that
    // holds no copy of it yet; that daemon takes the drained one's role.
    const std::vector<std::vector<std::string>> holders = Impl::HoldersByRank(job);
    std::vector<Impl::RankMove> targets;
    for (size_t r = 0; r < holders.size(); ++r) {
      if (!std::count(holders[r].begin(), holders[r].end(), from)) continue;
      // A rank still moving (to this daemon, or away from another holder) waits for its move:
      // a second move planned on top of it would never finish.
      for (const v1::PendingMove& m : job.moves()) {
        if (m.rank() != static_cast<int32_t>(r)) continue;
        return absl::FailedPreconditionError(absl::StrCat(
            "cannot drain ", from, " yet: rank ", r, " of job ", job_id, " is still moving from ",
            m.source_daemon_id(), " to ", m.target_daemon_id(), "; retry once it has moved (nothing was moved)"));
      }
      std::vector<std::vector<std::string>> others(1);
      for (const std::string& id : holders[r]) {
        if (id != from) others[0].push_back(id);
      }
      absl::StatusOr<std::vector<std::vector<std::string>>> target =
          AddCopies(others, static_cast<int>(others[0].size()) + 1, candidates, job.bytes_per_rank());
      if (!target.ok()) {
        return absl::ResourceExhaustedError(absl::StrCat("cannot drain ", from, ": no other ready daemon can take rank ",
                                                         r, " of job ", job_id, " (", target.status().message(),
                                                         "); nothing was moved"));
      }
      const std::string& to = (*target)[0][0];
      for (DaemonCandidate& c : candidates) {
        if (c.id == to) c.free_bytes -= job.bytes_per_rank();
      }
      targets.push_back({static_cast<int>(r), from, to});
    }
    if (targets.empty()) continue;
    std::vector<v1::ShardMove> moves;
    v1::StoredJob updated = s.PlanMoves(job, targets, &moves);
    for (v1::ShardMove& m : moves) *response.add_moves() = std::move(m);
    batch.PutJob(updated);
    moved.push_back(std::move(updated));
  }
  MAINSTAY_RETURN_IF_ERROR(s.Commit(batch));
  // The targets copy the state from this daemon, which keeps it until they report it loaded
  // (ReconcileLocked sends the DropShard then).
  if (!moved.empty()) s.FaultPoint("move-committed");
  for (const v1::StoredJob& job : moved) s.SendMoves(job);
  return response;
}

absl::StatusOr<v1::MoveShardResponse> Coordinator::MoveShard(const v1::MoveShardRequest& request) {
  Impl& s = *impl_;
  Impl::StateLock lock(s);
  s.TickLocked();
  MAINSTAY_ASSIGN_OR_RETURN(const v1::StoredJob* job, s.JobOrNotFound(request.job_id()));
  const int32_t rank = request.shard().shard();
  const int64_t dp = job->info().spec().data_parallel_size();
  if (rank < 0 || rank >= dp) {
    return absl::InvalidArgumentError(absl::StrCat("shard: rank ", rank, " is outside [0, ", dp, ") of job ",
                                                   request.job_id()));
  }
  const std::vector<std::string> holders = Impl::HoldersByRank(*job).at(static_cast<size_t>(rank));
  const std::string& owner = holders.front();
  if (owner == request.to_daemon_id()) {
    return absl::FailedPreconditionError(absl::StrCat("rank ", rank, " of job ", request.job_id(), " is already on ",
                                                      owner));
  }
  if (std::count(holders.begin(), holders.end(), request.to_daemon_id())) {
    return absl::FailedPreconditionError(absl::StrCat(
        "daemon ", request.to_daemon_id(), " already holds a replica of rank ", rank, " of job ", request.job_id(),
        "; the primary (", owner, ") can move only to a daemon without a copy of the rank"));
  }
  for (const v1::PendingMove& m : job->moves()) {
    if (m.rank() == rank) {
      return absl::FailedPreconditionError(absl::StrCat("rank ", rank, " of job ", request.job_id(),
                                                        " is still moving to ", m.target_daemon_id(), "; retry later"));
    }
  }
  std::vector<DaemonCandidate> candidates = s.Candidates("");
  auto target = std::find_if(candidates.begin(), candidates.end(),
                             [&](const DaemonCandidate& c) { return c.id == request.to_daemon_id(); });
  if (target == candidates.end()) {
    return absl::FailedPreconditionError(absl::StrCat("daemon '", request.to_daemon_id(),
                                                      "' is not a READY daemon (see mainstayctl daemons list)"));
  }
  if (target->free_bytes < job->bytes_per_rank()) {
    return absl::ResourceExhaustedError(absl::StrCat("daemon ", request.to_daemon_id(), " has ", target->free_bytes,
                                                     " bytes free; rank ", rank, " needs ", job->bytes_per_rank()));
  }
  std::vector<v1::ShardMove> moves;
  v1::StoredJob updated = s.PlanMoves(*job, {{rank, owner, request.to_daemon_id()}}, &moves);
  Batch batch;
  batch.PutJob(updated);
  MAINSTAY_RETURN_IF_ERROR(s.Commit(batch));
  s.FaultPoint("move-committed");
  s.SendMoves(updated);
  v1::MoveShardResponse response;
  for (v1::ShardMove& m : moves) *response.add_moves() = std::move(m);
  if (response.moves_size() > 0) *response.mutable_move() = response.moves(0);
  return response;
}

}  // namespace mainstay::coordinator
