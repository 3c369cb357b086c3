#include "server/coordinator/state.h"

namespace mainstay::coordinator {

void State::Apply(const v1::StateBatch& batch) {
  for (const v1::StateRecord& r : batch.records()) {
    switch (r.change_case()) {
      case v1::StateRecord::kPutDaemon:
        daemons[r.put_daemon().endpoint().daemon_id()] = r.put_daemon();
        break;
      case v1::StateRecord::kPutJob:
        jobs[r.put_job().info().job_id()] = r.put_job();
        break;
      case v1::StateRecord::kDeleteJob:
        jobs.erase(r.delete_job());
        break;
      case v1::StateRecord::kPutKv:
        kv[r.put_kv().key()] = r.put_kv();
        break;
      case v1::StateRecord::kDeleteKv:
        kv.erase(r.delete_kv());
        break;
      case v1::StateRecord::CHANGE_NOT_SET:
        break;
    }
  }
  counters = batch.counters();
  sequence = batch.sequence();
}

v1::CoordinatorState State::ToProto() const {
  v1::CoordinatorState proto;
  proto.set_sequence(sequence);
  for (const auto& [id, d] : daemons) *proto.add_daemons() = d;
  for (const auto& [id, j] : jobs) *proto.add_jobs() = j;
  for (const auto& [key, e] : kv) *proto.add_kv() = e;
  *proto.mutable_counters() = counters;
  return proto;
}

State State::FromProto(const v1::CoordinatorState& proto) {
  State state;
  state.sequence = proto.sequence();
  for (const v1::DaemonInfo& d : proto.daemons()) state.daemons[d.endpoint().daemon_id()] = d;
  for (const v1::StoredJob& j : proto.jobs()) state.jobs[j.info().job_id()] = j;
  for (const v1::KvEntry& e : proto.kv()) state.kv[e.key()] = e;
  state.counters = proto.counters();
  return state;
}

}  // namespace mainstay::coordinator
