// The Shard service's data-plane streams (docs/transports.md, "Chunks and pipelining"), served
// by ShardService (shard_service.cc) as raw (ByteBuffer) callback methods, so that their chunks
// bypass protobuf (common/grpc_chunk.h):
//
//   PushGrad    the header is validated before any data; each chunk lands from gRPC's receive
//               slices into the core's PushSession; nothing is stored until the stream ends well.
//               The stream is registered with `streams` (idle and replaced streams are cancelled).
//   PullParams  parked until the version is decided (server/grpc/waiters.h: no thread while it
//               waits), then the header, data chunks and scale chunks, each written when the
//               previous one is done; whole chunks reference the published version's bytes.
//
// Errors (as gRPC statuses with the daemon's ErrorDetail): PushGrad INVALID_ARGUMENT for a
// malformed stream (no header first, a second header, a message that is no PushGradRequest, a
// chunk out of order or over 4 MiB, a CRC-32C trailer not announced by the header, a second one
// or anything after it, an announced one missing) and the core's codes for the push itself
// (DATA_LOSS for a CRC-32C that does not match); CANCELLED when the
// trainer, the idle timeout or a newer stream of the same push ended it (nothing stored);
// UNAVAILABLE while the daemon stops or drains. PullParams INVALID_ARGUMENT for a request that
// does not parse or a bad delta request, the core's codes for the version, CANCELLED when the
// trainer went away mid-stream.
//
// Ownership: the reactors delete themselves (OnDone); every pointer passed in must outlive the
// call (the server's members); the metric counters and `drain` may be null. Thread safety: gRPC
// runs one callback of a reactor at a time; the core is thread-safe.
#ifndef MAINSTAY_SERVER_GRPC_DATA_STREAMS_H_
#define MAINSTAY_SERVER_GRPC_DATA_STREAMS_H_

#include <grpcpp/grpcpp.h>

#include <cstdint>

#include "common/chunk_limits.h"
#include "server/daemon/shard_daemon.h"
#include "server/daemon/step_drain.h"
#include "server/grpc/calls.h"
#include "server/grpc/push_streams.h"
#include "server/grpc/waiters.h"
#include "server/metrics/daemon_metrics.h"

namespace mainstay::daemon {

inline constexpr int64_t kDefaultChunkBytes = 1 << 20;  // a pull's chunks when the request names none

// The chunk size of a stream whose request asked for `requested` bytes (0: the default),
// capped at kMaxChunkBytes and rounded down to whole elements of every type.
int64_t ChunkBytes(int64_t requested);

// UNAVAILABLE "daemon is shutting down": every Shard call's answer once the daemon stops.
::grpc::Status ShuttingDown();

::grpc::ServerReadReactor<::grpc::ByteBuffer>* NewPushGradReactor(ShardDaemon* core, grpc_server::Calls* calls,
                                                                  metrics::Counter* pushed_bytes, StepDrain* drain,
                                                                  PushStreams* streams,
                                                                  ::grpc::CallbackServerContext* context,
                                                                  ::grpc::ByteBuffer* response);
// `request` is the call's message, parsed here (INVALID_ARGUMENT when it is not a request).
::grpc::ServerWriteReactor<::grpc::ByteBuffer>* NewPullWriter(ShardDaemon* core, grpc_server::Calls* calls,
                                                              grpc_server::Waiters* waiters,
                                                              metrics::Counter* pulled_bytes,
                                                              ::grpc::CallbackServerContext* context,
                                                              const ::grpc::ByteBuffer& request);

}  // namespace mainstay::daemon

#endif  // MAINSTAY_SERVER_GRPC_DATA_STREAMS_H_
