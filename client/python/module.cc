// The Python module `mainstay`: Client, PushHandle, PullHandle, plus Layout / PulledBucket
// (py_layout.cc, py_pulled.cc). Built over the public C++ API of libmainstay_client only.
//
// The GIL is released during every blocking call (connect, waits, finish_step, dequantize).
// Arrays given to a push are kept alive by the handle and by the client: a gradient's until
// finish_step of its step succeeded (finish_step may push it again: step_attempts), initial
// parameters until the push is done. Do not modify them before.
#include <chrono>
#include <string>
#include <utility>
#include <vector>

#include "client/python/py_common.h"

namespace mainstay::python {
namespace {

std::chrono::milliseconds Millis(double seconds) {
  return std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000.0));
}

class PyPushHandle {
 public:
  PyPushHandle(PushHandle handle, py::object keep) : handle_(std::move(handle)), keep_(std::move(keep)) {}
  bool ready() const { return handle_.ready(); }
  py::dict wait() {
    {
      py::gil_scoped_release release;
      handle_.Wait();
    }
    return PushResultDict(Take(handle_.Wait()));
  }

 private:
  PushHandle handle_;
  py::object keep_;  // the pushed array
};

class PyPullHandle {
 public:
  explicit PyPullHandle(PullHandle handle) : handle_(std::move(handle)) {}
  bool ready() const { return handle_.ready(); }
  PulledBucket wait() {
    {
      py::gil_scoped_release release;
      handle_.Wait();
    }
    return Take(handle_.Wait());
  }

 private:
  PullHandle handle_;
};

class PyClient {
 public:
  PyClient(const std::string& coordinator, const py::object& spec_json, const py::object& job_id,
           const py::object& job_token, int32_t rank, double timeout_s, const std::string& admin_token,
           int64_t chunk_bytes, double initial_backoff_s, double max_backoff_s, const std::string& tls_ca_file,
           const std::string& tls_cert_file, const std::string& tls_key_file, const std::string& tls_server_name,
           const std::string& transport, int64_t pull_buffer_cache_bytes, const py::object& reader_token,
           int step_attempts, bool replica_copies) {
    ClientOptions o;
    o.step_attempts = step_attempts;
    o.replica_copies = replica_copies;
    if (!reader_token.is_none()) o.reader_token = reader_token.cast<std::string>();
    o.transport = transport;
    o.pull_buffer_cache_bytes = pull_buffer_cache_bytes;
    o.coordinator = coordinator;
    if (!spec_json.is_none()) o.job_spec_json = spec_json.cast<std::string>();
    if (!job_id.is_none()) o.job_id = job_id.cast<std::string>();
    if (!job_token.is_none()) o.job_token = job_token.cast<std::string>();
    o.admin_token = admin_token;
    o.rank = rank;
    o.timeout = Millis(timeout_s);
    o.chunk_bytes = chunk_bytes;
    o.initial_backoff = Millis(initial_backoff_s);
    o.max_backoff = Millis(max_backoff_s);
    o.tls.ca_file = tls_ca_file;
    o.tls.cert_file = tls_cert_file;
    o.tls.key_file = tls_key_file;
    o.tls.server_name = tls_server_name;
    absl::StatusOr<std::unique_ptr<Client>> client;
    {
      py::gil_scoped_release release;
      client = Client::Connect(o);
    }
    client_ = Take(std::move(client));
    layout_ = PyLayout{client_->shared_layout()};
  }

  ~PyClient() {
    {
      py::gil_scoped_release release;
      client_.reset();  // waits for outstanding pushes, which read the arrays in pending_
    }
    pending_.clear();
  }

  Client& client() { return *client_; }
  const PyLayout& layout() const { return layout_; }

  py::dict Placement() const {
    const JobPlacement p = client_->placement();
    py::dict d;
    d["epoch"] = p.epoch;
    py::list shards;
    for (const ShardOwner& s : p.shards) {
      py::dict sd;
      sd["bucket"] = s.bucket;
      sd["shard"] = s.shard;
      sd["daemon_id"] = s.daemon_id;
      sd["replica_daemon_ids"] = py::cast(s.replica_daemon_ids);
      shards.append(sd);
    }
    d["shards"] = shards;
    py::list daemons;
    for (const DaemonAddress& a : p.daemons) {
      py::dict dd;
      dd["daemon_id"] = a.daemon_id;
      dd["address"] = a.address;
      dd["node_name"] = a.node_name;
      daemons.append(dd);
    }
    d["daemons"] = daemons;
    return d;
  }

  // Registers a push of `step` (-1: initial parameters): its array stays referenced until the
  // push is done and, for a gradient, a FinishStep of a step >= `step` called after the push
  // succeeded (the client may push it again until then; after a restore the same steps are
  // pushed again, and an older FinishStep says nothing of those pushes).
  py::object Track(PushHandle handle, py::object keep, bool wait, int64_t step) {
    Prune();
    PyPushHandle h(handle, keep);
    pending_.push_back({handle, std::move(keep), step, next_push_++});
    if (wait) return h.wait();
    return py::cast(std::move(h));
  }

  // `cuda_stream` / `cuda_event`: None, or a raw CUDA handle as an int (PyTorch:
  // torch.cuda.current_stream().cuda_stream, 0 = the legacy default stream; an event's
  // .cuda_event), as PushOptions::cuda_stream / cuda_event take them.
  // `array_stream`: the stream a CUDA array's interface named (SpanOf), used when the caller
  // names neither a stream nor an event.
  PushOptions Options(double loss_scale, double timeout_s, const py::object& cuda_stream = py::none(),
                      const py::object& cuda_event = py::none(),
                      std::optional<void*> array_stream = std::nullopt) const {
    PushOptions o;
    o.loss_scale = loss_scale;
    o.timeout = Millis(timeout_s);
    if (!cuda_stream.is_none()) o.cuda_stream = CudaHandle(cuda_stream, "cuda_stream");
    if (!cuda_event.is_none()) o.cuda_event = CudaHandle(cuda_event, "cuda_event");
    if (cuda_stream.is_none() && cuda_event.is_none()) o.cuda_stream = array_stream;
    return o;
  }

  // PullIntoOptions from the same arguments as Options.
  PullIntoOptions IntoOptions(double timeout_s, const py::object& cuda_stream, const py::object& cuda_event,
                              std::optional<void*> array_stream) const {
    const PushOptions po = Options(0.0, timeout_s, cuda_stream, cuda_event, array_stream);
    PullIntoOptions o;
    o.timeout = po.timeout;
    o.cuda_stream = po.cuda_stream;
    o.cuda_event = po.cuda_event;
    return o;
  }

  static void* CudaHandle(const py::object& handle, const char* name) {
    if (!py::isinstance<py::int_>(handle) || handle.cast<py::int_>() < py::int_(0)) {
      throw py::type_error(absl::StrCat(name, " must be None or a CUDA handle as a non-negative int, got ",
                                        py::str(py::repr(handle)).cast<std::string>()));
    }
    return reinterpret_cast<void*>(static_cast<uintptr_t>(handle.cast<uint64_t>()));
  }

  // lr and weight_decay for every param group, or `groups`: one (lr, weight_decay) pair or
  // {"lr": ..., "weight_decay": ...} dict per group.
  py::dict FinishStep(int64_t step, const py::object& lr, const py::object& weight_decay, const py::object& groups,
                      double timeout_s) {
    StepHyper hyper;
    if (groups.is_none()) {
      if (lr.is_none() || weight_decay.is_none()) {
        throw py::type_error("finish_step: give lr and weight_decay (applied to every param group) or groups");
      }
      hyper.assign(static_cast<size_t>(NumParamGroups(client_->layout())),
                   GroupHyper{lr.cast<double>(), weight_decay.cast<double>()});
    } else {
      if (!lr.is_none() || !weight_decay.is_none()) {
        throw py::type_error("finish_step: give either lr and weight_decay or groups, not both");
      }
      for (const py::handle g : groups) {
        if (py::isinstance<py::dict>(g)) {
          const py::dict d = py::reinterpret_borrow<py::dict>(g);
          if (!d.contains("lr") || !d.contains("weight_decay")) {
            throw py::value_error("finish_step: each entry of groups needs \"lr\" and \"weight_decay\"");
          }
          hyper.push_back({d["lr"].cast<double>(), d["weight_decay"].cast<double>()});
        } else {
          const auto pair = g.cast<std::pair<double, double>>();
          hyper.push_back({pair.first, pair.second});
        }
      }
    }
    absl::StatusOr<StepStats> stats;
    const uint64_t pushed_before = next_push_;
    {
      py::gil_scoped_release release;
      stats = client_->FinishStep(step, hyper, Millis(timeout_s));
    }
    for (Pending& p : pending_) p.finished |= stats.ok() && p.push < pushed_before && p.step <= step;
    Prune();
    return StepStatsDict(Take(std::move(stats)));
  }

  py::object Pull(PullHandle handle, bool wait) {
    PyPullHandle h(std::move(handle));
    if (wait) return py::cast(h.wait());
    return py::cast(std::move(h));
  }

 private:
  struct Pending {
    PushHandle handle;
    py::object array;
    int64_t step;           // -1: initial parameters
    uint64_t push;          // the order of Track calls
    bool finished = false;  // a FinishStep of a step >= `step`, called after the push, succeeded
  };
  void Prune() {
    std::vector<Pending> still;
    for (Pending& p : pending_) {
      if (!p.handle.ready() || (p.step >= 0 && !p.finished)) still.push_back(std::move(p));
    }
    pending_.swap(still);
  }

  std::vector<Pending> pending_;  // declared first: released last
  uint64_t next_push_ = 0;
  std::unique_ptr<Client> client_;
  PyLayout layout_;
};

AdminCallOptions AdminOptions(const py::object& admin_token, double timeout_s) {
  AdminCallOptions o;
  if (!admin_token.is_none()) o.admin_token = admin_token.cast<std::string>();
  o.timeout = Millis(timeout_s);
  return o;
}

py::dict CheckpointDict(const CheckpointInfo& c) {
  py::dict d;
  d["checkpoint_id"] = c.checkpoint_id;
  d["job_id"] = c.job_id;
  d["job_name"] = c.job_name;
  d["version"] = c.version;
  d["state"] = c.state;
  d["created_unix_ms"] = c.created_unix_ms;
  d["size_bytes"] = c.size_bytes;
  d["file_count"] = c.file_count;
  d["manifest_uri"] = c.manifest_uri;
  d["error"] = c.error;
  return d;
}

}  // namespace

// The compiled part of the package `mainstay` (client/python/mainstay/__init__.py re-exports it).
PYBIND11_MODULE(_mainstay, m) {
  m.doc() = "Mainstay trainer client: push gradients, finish steps, pull quantized parameters.";
  BindLayout(m);
  BindPulled(m);

  py::class_<PyPushHandle>(m, "PushHandle", "An asynchronous push; wait() returns its result dict.")
      .def("ready", &PyPushHandle::ready)
      .def("wait", &PyPushHandle::wait);
  py::class_<PyPullHandle>(m, "PullHandle", "An asynchronous pull; wait() returns the PulledBucket.")
      .def("ready", &PyPullHandle::ready)
      .def("wait", &PyPullHandle::wait);

  py::class_<VersionPin>(m, "VersionPin", "A version pinned on every daemon that serves the job's pulls.")
      .def_readonly("version", &VersionPin::version)
      .def_readonly("expires_unix_ms", &VersionPin::expires_unix_ms)
      .def_property_readonly("daemons", [](const VersionPin& p) { return p.pins.size(); },
                             "how many daemons hold the pin (primaries, and the replicas that keep the version)")
      .def("__repr__", [](const VersionPin& p) {
        return absl::StrCat("VersionPin(version=", p.version, ", daemons=", p.pins.size(), ")");
      });
  py::class_<PyClient>(m, "Client",
                       "Attaches to a job (job_id + job_token) or creates it (spec_json), then pushes, finishes "
                       "steps and pulls. With job_id + reader_token instead it only pulls (see WeightReader). Methods are thread-safe; blocking calls release the GIL.")
      .def(py::init<const std::string&, const py::object&, const py::object&, const py::object&, int32_t, double,
                    const std::string&, int64_t, double, double, const std::string&, const std::string&,
                    const std::string&, const std::string&, const std::string&, int64_t, const py::object&, int, bool>(),
           py::arg("coordinator"), py::arg("spec_json") = py::none(), py::arg("job_id") = py::none(),
           py::arg("job_token") = py::none(), py::arg("rank") = 0, py::arg("timeout_s") = 60.0,
           py::arg("admin_token") = "", py::arg("chunk_bytes") = 4 << 20, py::arg("initial_backoff_s") = 0.05,
           py::arg("max_backoff_s") = 2.0, py::arg("tls_ca_file") = "", py::arg("tls_cert_file") = "",
           py::arg("tls_key_file") = "", py::arg("tls_server_name") = "", py::arg("transport") = "",
           py::arg("pull_buffer_cache_bytes") = -1, py::arg("reader_token") = py::none(), py::arg("step_attempts") = 8,
           py::arg("replica_copies") = true)
      .def_readonly_static("LATEST", &Client::kLatestVersion)
      .def_property_readonly("reader", [](PyClient& c) { return c.client().reader(); },
                             "True when attached with a reader token (pulls only).")
      .def("pin_version", [](PyClient& c, int64_t version, double ttl_s) {
        absl::StatusOr<VersionPin> pin;
        {
          py::gil_scoped_release release;
          pin = c.client().PinVersion(version, Millis(ttl_s));
        }
        return Take(std::move(pin));
      }, py::arg("version"), py::arg("ttl_s") = 60.0,
         "Keeps `version` from eviction on every daemon for ttl_s seconds (at most 600); returns a VersionPin.")
      .def("pin_newest_version", [](PyClient& c, double ttl_s) {
        absl::StatusOr<VersionPin> pin;
        {
          py::gil_scoped_release release;
          pin = c.client().PinNewestVersion(Millis(ttl_s));
        }
        return Take(std::move(pin));
      }, py::arg("ttl_s") = 60.0, "The newest published version, pinned (VersionPin.version says which).")
      .def("release_pin", [](PyClient& c, const VersionPin& pin) {
        absl::Status s;
        {
          py::gil_scoped_release release;
          s = c.client().ReleasePin(pin);
        }
        Check(s);
      }, py::arg("pin"))
      .def("get_reader_token", [](PyClient& c, bool rotate) {
        absl::StatusOr<std::string> token;
        {
          py::gil_scoped_release release;
          token = c.client().GetReaderToken(rotate);
        }
        return Take(std::move(token));
      }, py::arg("rotate") = false,
         "The job's read-only reader token (for mainstay.WeightReader); rotate=True replaces it.")
      .def_property_readonly("job_id", [](PyClient& c) { return c.client().job_id(); })
      .def_property_readonly("job_token", [](PyClient& c) { return c.client().job_token(); })
      .def_property_readonly("rank", [](PyClient& c) { return c.client().rank(); })
      .def_property_readonly("data_parallel_size", [](PyClient& c) { return c.client().data_parallel_size(); })
      .def_property_readonly("version", [](PyClient& c) { return c.client().version_at_connect(); })
      .def_property_readonly("layout", &PyClient::layout)
      .def_property_readonly("placement", &PyClient::Placement)
      .def("connections", [](PyClient& c) {
        py::list out;
        for (const DataConnection& d : c.client().connections()) {
          py::dict e;
          e["daemon_id"] = d.daemon_id;
          e["address"] = d.address;
          e["transport"] = d.transport;
          e["note"] = d.note;
          out.append(e);
        }
        return out;
      }, "The transport used with each daemon of the placement: [{daemon_id, address, transport, note}].")
      .def("refresh_placement", [](PyClient& c) {
        absl::Status s;
        {
          py::gil_scoped_release release;
          s = c.client().RefreshPlacement();
        }
        Check(s);
      })
      .def("push_grad", [](PyClient& c, int32_t bucket, int64_t step, const py::object& grad, bool wait,
                           double loss_scale, const std::string& dtype, double timeout_s, const py::object& cuda_stream,
                           const py::object& cuda_event) {
        py::object keep;
        std::optional<void*> stream;
        ElementSpan span = SpanOf(grad, dtype, &keep, &stream);
        return c.Track(c.client().PushGrad(bucket, step, span, c.Options(loss_scale, timeout_s, cuda_stream, cuda_event,
                                                                          stream)),
                       keep, wait, step);
      }, py::arg("bucket"), py::arg("step"), py::arg("grad"), py::arg("wait") = false, py::arg("loss_scale") = 0.0,
         py::arg("dtype") = "", py::arg("timeout_s") = 0.0, py::kw_only(), py::arg("cuda_stream") = py::none(),
         py::arg("cuda_event") = py::none(),
         "Reduced mode: this rank's shard (shard_numel elements) of the bucket's reduced gradient: a numpy "
         "array, or a CUDA array (__cuda_array_interface__) for the nccl and cuda_ipc transports. "
         "cuda_stream / cuda_event (raw handles as ints): the push waits for that CUDA work before it reads the "
         "buffer (e.g. an asynchronous copy into pinned memory); by default, for the stream a CUDA array names.")
      .def("push_shard", [](PyClient& c, int32_t bucket, int32_t shard, int64_t step, const py::object& grad,
                            int32_t num_contributors, bool wait, double loss_scale, const std::string& dtype,
                            double timeout_s, const py::object& cuda_stream, const py::object& cuda_event) {
        py::object keep;
        std::optional<void*> stream;
        ElementSpan span = SpanOf(grad, dtype, &keep, &stream);
        return c.Track(c.client().PushShard(bucket, shard, step, span, num_contributors,
                                            c.Options(loss_scale, timeout_s, cuda_stream, cuda_event, stream)),
                       keep, wait, step);
      }, py::arg("bucket"), py::arg("shard"), py::arg("step"), py::arg("grad"), py::arg("num_contributors"),
         py::arg("wait") = false, py::arg("loss_scale") = 0.0, py::arg("dtype") = "", py::arg("timeout_s") = 0.0,
         py::kw_only(), py::arg("cuda_stream") = py::none(), py::arg("cuda_event") = py::none())
      .def("push_bucket_unreduced", [](PyClient& c, int32_t bucket, int64_t step, const py::object& grad, bool wait,
                                       double loss_scale, const std::string& dtype, double timeout_s,
                                       const py::object& cuda_stream, const py::object& cuda_event) {
        py::object keep;
        std::optional<void*> stream;
        ElementSpan span = SpanOf(grad, dtype, &keep, &stream);
        return c.Track(c.client().PushBucketUnreduced(bucket, step, span,
                                                      c.Options(loss_scale, timeout_s, cuda_stream, cuda_event, stream)),
                       keep, wait, step);
      }, py::arg("bucket"), py::arg("step"), py::arg("grad"), py::arg("wait") = false, py::arg("loss_scale") = 0.0,
         py::arg("dtype") = "", py::arg("timeout_s") = 0.0, py::kw_only(), py::arg("cuda_stream") = py::none(),
         py::arg("cuda_event") = py::none(),
         "Unreduced mode: this rank's own gradient of the whole bucket; the daemons sum the D ranks.")
      .def("push_initial_params", [](PyClient& c, int32_t bucket, const py::array& params, bool all_shards, bool wait,
                                     double timeout_s) {
        py::array_t<float, py::array::c_style | py::array::forcecast> a(params);
        py::object keep = a;
        std::span<const float> values(a.data(), static_cast<size_t>(a.size()));
        return c.Track(c.client().PushInitialParams(bucket, values, all_shards, c.Options(0.0, timeout_s)), keep,
                       wait, -1);
      }, py::arg("bucket"), py::arg("params"), py::arg("all_shards") = false, py::arg("wait") = true,
         py::arg("timeout_s") = 0.0,
         "Initial FP32 parameters (version 0): the whole bucket or this rank's shard.")
      .def("finish_step", &PyClient::FinishStep, py::arg("step"), py::arg("lr") = py::none(),
           py::arg("weight_decay") = py::none(), py::kw_only(), py::arg("groups") = py::none(),
           py::arg("timeout_s") = 0.0,
           "Ends the step for this rank; blocks until it is committed or skipped. lr and weight_decay apply to "
           "every param group; or groups gives one (lr, weight_decay) pair (or dict) per param group, in order "
           "(layout.num_param_groups entries).")
      .def("get_step_stats", [](PyClient& c, int64_t step) {
        absl::StatusOr<StepStats> s;
        {
          py::gil_scoped_release release;
          s = c.client().GetStepStats(step);
        }
        return StepStatsDict(Take(std::move(s)));
      })
      .def("pull_bucket", [](PyClient& c, int32_t bucket, int64_t version, bool wait, double timeout_s,
                             const PulledBucket* since) {
        if (since != nullptr) return c.Pull(c.client().PullBucketSince(bucket, version, *since, Millis(timeout_s)), wait);
        return c.Pull(c.client().PullBucket(bucket, version, Millis(timeout_s)), wait);
      }, py::arg("bucket"), py::arg("version"), py::arg("wait") = true, py::arg("timeout_s") = 0.0,
         py::arg("since") = nullptr,
         "Every shard of the bucket at `version` (Client.LATEST: the newest), in parallel. since: a whole "
         "earlier pull of the bucket (a PulledBucket): only the 64 KiB chunks of data that changed since then "
         "come, as byte patches where the daemons still keep since's version (delta sync, over grpc); the result is a new PulledBucket, checked against the daemons' "
         "CRC-32C, and `since` is left as it is.")
      .def("pull_shard", [](PyClient& c, int32_t bucket, int32_t shard, int64_t version, bool wait, double timeout_s) {
        return c.Pull(c.client().PullShard(bucket, shard, version, Millis(timeout_s)), wait);
      }, py::arg("bucket"), py::arg("shard"), py::arg("version"), py::arg("wait") = true, py::arg("timeout_s") = 0.0)
      .def("pull_shard_into", [](PyClient& c, int32_t bucket, int32_t shard, int64_t version, const py::object& out,
                                 double timeout_s, const py::object& cuda_stream, const py::object& cuda_event) {
        std::optional<void*> array_stream;
        const std::span<uint8_t> dest = DestinationOf(out, &array_stream);
        const PullIntoOptions o = c.IntoOptions(timeout_s, cuda_stream, cuda_event, array_stream);
        absl::StatusOr<PulledShard> r;
        {
          py::gil_scoped_release release;
          r = c.client().PullShardInto(bucket, shard, version, dest.data(), static_cast<int64_t>(dest.size()), o).Wait();
        }
        return PulledShardDict(Take(std::move(r)));
      }, py::arg("bucket"), py::arg("shard"), py::arg("version"), py::arg("out"), py::arg("timeout_s") = 0.0,
         py::kw_only(), py::arg("cuda_stream") = py::none(), py::arg("cuda_event") = py::none(),
         "One shard of `version` straight into `out`, blocking: a writable, C-contiguous numpy array or CUDA array "
         "(__cuda_array_interface__) of exactly the shard's packed bytes (layout.buckets[b]['shard_bytes']). A CUDA "
         "array needs transport='cuda_ipc': the daemon writes into it by its CUDA IPC handle, after the CUDA work "
         "that uses it (cuda_stream / cuda_event as for push_grad; by default the stream the array names). Returns "
         "{shard, version, unchanged (nothing written), num_scales, scales (bytes), fragments: [{tensor, elements, "
         "bucket_offset, scale, scale_inv, amax, scale_blocks, scale_offset}]}.")
      .def("pull_bucket_into", [](PyClient& c, int32_t bucket, int64_t version, const py::object& out,
                                  double timeout_s, const py::object& cuda_stream, const py::object& cuda_event) {
        std::optional<void*> array_stream;
        const std::span<uint8_t> dest = DestinationOf(out, &array_stream);
        const PullIntoOptions o = c.IntoOptions(timeout_s, cuda_stream, cuda_event, array_stream);
        absl::StatusOr<std::vector<PulledShard>> r;
        {
          py::gil_scoped_release release;
          r = c.client().PullBucketInto(bucket, version, dest.data(), static_cast<int64_t>(dest.size()), o).Wait();
        }
        py::list shards;
        for (const PulledShard& p : Take(std::move(r))) shards.append(PulledShardDict(p));
        return shards;
      }, py::arg("bucket"), py::arg("version"), py::arg("out"), py::arg("timeout_s") = 0.0, py::kw_only(),
         py::arg("cuda_stream") = py::none(), py::arg("cuda_event") = py::none(),
         "Every shard of the bucket into its slice of `out` (the bucket's packed bytes in bucket order, "
         "layout.buckets[b]['bucket_bytes']; for a bf16 bucket, its bf16 values), in parallel, as pull_shard_into. "
         "Returns one dict per shard, in order.")
      .def("create_checkpoint", [](PyClient& c, bool wait, const py::object& admin_token, double timeout_s) {
        const AdminCallOptions o = AdminOptions(admin_token, timeout_s);
        absl::StatusOr<CheckpointInfo> info;
        {
          py::gil_scoped_release release;
          info = c.client().CreateCheckpoint(wait, o);
        }
        return CheckpointDict(Take(std::move(info)));
      }, py::arg("wait") = true, py::arg("admin_token") = py::none(), py::arg("timeout_s") = 0.0,
         "Admin CreateCheckpoint of this job at its committed version -> checkpoint info dict. admin_token: "
         "None = the one given to Client().")
      .def("restore_checkpoint", [](PyClient& c, const std::string& checkpoint_id, const py::object& admin_token,
                                    double timeout_s) {
        const AdminCallOptions o = AdminOptions(admin_token, timeout_s);
        absl::StatusOr<RestoreResult> r;
        {
          py::gil_scoped_release release;
          r = c.client().RestoreCheckpoint(checkpoint_id, o);
        }
        const RestoreResult result = Take(std::move(r));
        py::dict d;
        d["version"] = result.version;
        d["placement_epoch"] = result.placement_epoch;
        return d;
      }, py::arg("checkpoint_id"), py::arg("admin_token") = py::none(), py::arg("timeout_s") = 0.0,
         "Admin RestoreCheckpoint into this job -> {version, placement_epoch}; pull that version next.");
}

}  // namespace mainstay::python
