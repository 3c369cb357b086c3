// libFuzzer target: the fuzz input mutates PullParams streams as a daemon could send them, and
// the client's ShardPullAssembler (client/src/pull_assembly.h) takes them as untrusted input.
// The layout is the client tests' every-format job (D = 2, small buckets); the first bytes pick
// the bucket, the shard, the chunk size and the kind of stream:
//  - a full pull of version B;
//  - a delta from the reader's copy of version A to B (changed data chunks, whole);
//  - the same with byte patches (common/byte_patch.h) where smaller;
//  - the same with the block scales as a delta too.
// The correct stream is built as the daemon builds it; then up to 8 mutations from the input
// each change one message: a byte of its data, patch or scales flipped; its offset moved; a
// patch cut short, grown with input bytes, or swapped for data (and back); a message dropped or
// repeated; a chunk index listed or unlisted in the header; a CRC changed. An input of zeros is
// the correct stream.
//
// Invariants (a violation aborts, so libFuzzer reports it with the input):
//  - no crash, out-of-bounds write or UB (built with -fsanitize=fuzzer,address,undefined);
//  - every failure is INTERNAL (a broken protocol) or DATA_LOSS (a CRC that does not match);
//  - the unmutated stream is accepted, and yields exactly B's data and scales;
//  - whatever is accepted is what the header's CRC-32Cs say: the data's, and for a delta of the
//    scales, the scales';
//  - the bytes outside the shard's slice of the buffer are never touched.
#include <fuzzer/FuzzedDataProvider.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "client/src/pull_assembly.h"
#include "client/src/testing/fake_services.h"
#include "client/src/testing/test_specs.h"
#include "common/crc32c.h"
#include "common/job_spec.h"
#include "mainstay/v1/shard.pb.h"
#include "tests/fuzz/fuzz_check.h"

namespace mainstay {
namespace {

using fuzz::Check;
using fuzz::Fail;

enum class Kind { kFull, kDelta, kPatches, kScales };

struct Streams {
  std::shared_ptr<const Layout> layout;
  // Per (bucket, shard): the full streams of versions A and B.
  std::vector<std::vector<std::vector<v1::PullParamsResponse>>> a, b;
};

std::vector<float> Master(const Layout& layout, int32_t bucket, uint32_t seed) {
  std::mt19937 rng(seed + static_cast<uint32_t>(bucket));
  std::normal_distribution<float> dist(0.0f, 0.1f);
  std::vector<float> master(static_cast<size_t>(layout.buckets[bucket].numel));
  for (float& x : master) x = dist(rng);
  return master;
}

const Streams& AllStreams() {
  static const Streams* streams = [] {
    auto* s = new Streams;
    absl::StatusOr<ResolvedJob> job = ResolveJob(*ParseJobSpecJson(testing_fakes::AllFormatsSpec(2)));
    if (!job.ok()) Fail(job.status().ToString());
    s->layout = std::make_shared<const Layout>(job->layout);
    for (int32_t b = 0; b < static_cast<int32_t>(s->layout->buckets.size()); ++b) {
      std::vector<float> master = Master(*s->layout, b, 1);
      std::vector<float> moved = master;
      for (size_t i = 0; i < moved.size(); i += 61) moved[i] *= 1.7f;  // some codes and scales move
      s->a.emplace_back();
      s->b.emplace_back();
      for (int32_t shard = 0; shard < 2; ++shard) {
        auto a = testing_fakes::MakePullStream(*s->layout, b, shard, 3, master, 1 << 20);
        auto bb = testing_fakes::MakePullStream(*s->layout, b, shard, 4, moved, 256);
        if (!a.ok() || !bb.ok()) Fail("MakePullStream failed");
        s->a.back().push_back(*std::move(a));
        s->b.back().push_back(*std::move(bb));
      }
    }
    return s;
  }();
  return *streams;
}

std::vector<uint8_t> Collect(const std::vector<v1::PullParamsResponse>& stream, bool scales) {
  std::vector<uint8_t> out;
  for (const v1::PullParamsResponse& m : stream) {
    if (!scales && m.has_data()) out.insert(out.end(), m.data().data().begin(), m.data().data().end());
    if (scales && m.has_scales()) out.insert(out.end(), m.scales().data().begin(), m.scales().data().end());
  }
  return out;
}

absl::Status Run(const Layout& layout, int32_t bucket, int32_t shard, Kind kind, int64_t chunk,
                 const std::vector<v1::PullParamsResponse>& stream, std::span<uint8_t> out,
                 const std::vector<uint8_t>& a_scales, std::vector<uint8_t>* scales_out) {
  client_internal::ShardPullAssembler assembler(layout, bucket, shard, 4, out, /*verify_crc32c=*/true);
  if (kind != Kind::kFull) {
    assembler.ExpectDelta(chunk, kind != Kind::kDelta,
                          kind == Kind::kScales ? std::span<const uint8_t>(a_scales) : std::span<const uint8_t>());
  }
  for (const v1::PullParamsResponse& m : stream) {
    if (absl::Status s = assembler.OnMessage(m); !s.ok()) return s;
  }
  absl::StatusOr<PulledShard> result = assembler.Finish();
  if (!result.ok()) return result.status();
  *scales_out = result->scales;
  return absl::OkStatus();
}

}  // namespace
}  // namespace mainstay

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* bytes, size_t size) {
  using namespace mainstay;
  const Streams& all = AllStreams();
  const Layout& layout = *all.layout;
  FuzzedDataProvider in(bytes, size);
  const auto bucket = static_cast<int32_t>(in.ConsumeIntegral<uint8_t>() % layout.buckets.size());
  const int32_t shard = in.ConsumeIntegral<uint8_t>() % 2;
  const auto kind = static_cast<Kind>(in.ConsumeIntegral<uint8_t>() % 4);
  const int64_t chunk = int64_t{256} << (in.ConsumeIntegral<uint8_t>() % 3);
  const std::vector<v1::PullParamsResponse>& a = all.a[bucket][shard];
  const std::vector<v1::PullParamsResponse>& b = all.b[bucket][shard];
  const std::vector<uint8_t> a_data = Collect(a, false), b_data = Collect(b, false);
  const std::vector<uint8_t> a_scales = Collect(a, true), b_scales = Collect(b, true);

  // The correct stream.
  std::vector<v1::PullParamsResponse> stream;
  const bool scale_delta = kind == Kind::kScales && !b_scales.empty();
  if (kind == Kind::kFull) {
    stream = b;
  } else {
    const int bits = Describe(layout.buckets[bucket].format).bits_per_element;
    const int entry = b_scales.empty() ? 1 : static_cast<int>(b_scales.size() / b[0].header().total_scales());
    v1::PullParamsResponse header = b[0];
    v1::PullParamsHeader* h = header.mutable_header();
    h->set_delta(true);
    h->set_data_crc32c(Crc32c(b_data.data(), b_data.size()));
    stream.push_back(header);
    google::protobuf::RepeatedField<int32_t> listed;  // (not into stream[0]: the stream grows meanwhile)
    testing_fakes::ForEachDeltaChunk(a_data, b_data, chunk, kind != Kind::kDelta, &listed,
                                     [&](int64_t begin, std::string data, std::string patch) {
                                       v1::PullParamsResponse m;
                                       m.mutable_data()->set_element_offset(begin * 8 / bits);
                                       m.mutable_data()->set_data(std::move(data));
                                       m.mutable_data()->set_patch(std::move(patch));
                                       stream.push_back(std::move(m));
                                     });
    stream[0].mutable_header()->mutable_delta_chunks()->Swap(&listed);
    if (scale_delta) {
      stream[0].mutable_header()->set_delta_scales(true);
      stream[0].mutable_header()->set_scales_crc32c(Crc32c(b_scales.data(), b_scales.size()));
      testing_fakes::ForEachDeltaChunk(a_scales, b_scales, chunk, true, &listed,
                                       [&](int64_t begin, std::string data, std::string patch) {
                                         v1::PullParamsResponse m;
                                         m.mutable_scales()->set_scale_offset(begin / entry);
                                         m.mutable_scales()->set_data(std::move(data));
                                         m.mutable_scales()->set_patch(std::move(patch));
                                         stream.push_back(std::move(m));
                                       });
      stream[0].mutable_header()->mutable_delta_scale_chunks()->Swap(&listed);
    } else {
      for (const v1::PullParamsResponse& m : b) {
        if (m.has_scales()) stream.push_back(m);
      }
    }
  }

  // Mutations: each changes one message of the stream.
  const int mutations = in.ConsumeIntegralInRange<int>(0, 8);
  for (int i = 0; i < mutations && !stream.empty(); ++i) {
    const auto at = in.ConsumeIntegralInRange<size_t>(0, stream.size() - 1);
    const int op = in.ConsumeIntegral<uint8_t>() % 10;
    v1::PullParamsResponse& m = stream[at];
    std::string* payload = nullptr;
    std::string* other = nullptr;  // the data when the payload is a patch, and the other way round
    if (m.has_data()) {
      const bool patch = !m.data().patch().empty();
      payload = patch ? m.mutable_data()->mutable_patch() : m.mutable_data()->mutable_data();
      other = patch ? m.mutable_data()->mutable_data() : m.mutable_data()->mutable_patch();
    } else if (m.has_scales()) {
      const bool patch = !m.scales().patch().empty();
      payload = patch ? m.mutable_scales()->mutable_patch() : m.mutable_scales()->mutable_data();
      other = patch ? m.mutable_scales()->mutable_data() : m.mutable_scales()->mutable_patch();
    }
    v1::PullParamsHeader* h = m.has_header() ? m.mutable_header() : nullptr;
    switch (op) {
      case 0:  // a byte flipped
        if (payload != nullptr && !payload->empty()) {
          (*payload)[in.ConsumeIntegral<uint16_t>() % payload->size()] ^= static_cast<char>(in.ConsumeIntegral<uint8_t>() | 1);
        }
        break;
      case 1: {  // the offset moved
        const auto by = in.ConsumeIntegralInRange<int64_t>(-64, 64);
        if (m.has_data()) m.mutable_data()->set_element_offset(m.data().element_offset() + by);
        if (m.has_scales()) m.mutable_scales()->set_scale_offset(m.scales().scale_offset() + by);
        break;
      }
      case 2:  // cut short
        if (payload != nullptr && !payload->empty()) payload->resize(payload->size() - 1 - in.ConsumeIntegral<uint16_t>() % payload->size());
        break;
      case 3:  // grown with input bytes
        if (payload != nullptr) payload->append(in.ConsumeBytesAsString(in.ConsumeIntegralInRange<size_t>(1, 16)));
        break;
      case 4:  // a patch sent as data, or data as a patch
        if (payload != nullptr) payload->swap(*other);
        break;
      case 5:  // dropped
        stream.erase(stream.begin() + static_cast<std::ptrdiff_t>(at));
        break;
      case 6: {  // repeated
        v1::PullParamsResponse copy = m;
        stream.insert(stream.begin() + static_cast<std::ptrdiff_t>(at), std::move(copy));
        break;
      }
      case 7:  // a chunk listed or unlisted
        if (h != nullptr) {
          auto* listed = in.ConsumeBool() ? h->mutable_delta_chunks() : h->mutable_delta_scale_chunks();
          if (in.ConsumeBool() && !listed->empty()) {
            listed->RemoveLast();
          } else {
            listed->Add(in.ConsumeIntegral<uint8_t>() % 12);
          }
        }
        break;
      case 8:  // a CRC changed
        if (h != nullptr) {
          const uint32_t bit = 1u << (in.ConsumeIntegral<uint8_t>() % 32);
          if (in.ConsumeBool()) {
            h->set_data_crc32c(h->data_crc32c() ^ bit);
          } else {
            h->set_scales_crc32c(h->scales_crc32c() ^ bit);
          }
        }
        break;
      default:  // a delta flag flipped
        if (h != nullptr) {
          if (in.ConsumeBool()) {
            h->set_delta(!h->delta());
          } else {
            h->set_delta_scales(!h->delta_scales());
          }
        }
        break;
    }
  }

  // The shard's slice between two guard bands; a delta starts from A's data.
  constexpr size_t kGuard = 64;
  std::vector<uint8_t> buffer(kGuard + b_data.size() + kGuard, 0xA5);
  if (kind != Kind::kFull) std::memcpy(buffer.data() + kGuard, a_data.data(), a_data.size());
  const std::span<uint8_t> out(buffer.data() + kGuard, b_data.size());
  std::vector<uint8_t> scales_out;
  const absl::Status s = Run(layout, bucket, shard, kind, chunk, stream, out, a_scales, &scales_out);
  for (size_t i = 0; i < kGuard; ++i) {
    Check(buffer[i] == 0xA5 && buffer[buffer.size() - 1 - i] == 0xA5, "a byte outside the shard's slice was written");
  }
  Check(s.ok() || s.code() == absl::StatusCode::kInternal || s.code() == absl::StatusCode::kDataLoss,
        "unexpected status " + s.ToString());
  if (mutations == 0) {
    Check(s.ok(), absl::StrCat("the correct stream (kind ", static_cast<int>(kind), ") was refused: ", s.ToString()));
    Check(std::equal(out.begin(), out.end(), b_data.begin(), b_data.end()), "the correct stream gave other data");
    Check(scales_out == b_scales, "the correct stream gave other scales");
  }
  if (s.ok()) {
    const v1::PullParamsHeader* header = nullptr;
    for (const v1::PullParamsResponse& m : stream) {
      if (m.has_header()) {
        header = &m.header();
        break;
      }
    }
    Check(header != nullptr, "a stream without a header was accepted");
    if (!header->unchanged() && header->data_crc32c() != 0) {
      Check(Crc32c(out.data(), out.size()) == header->data_crc32c(), "accepted data that fails the header's CRC-32C");
    }
    if (header->delta_scales()) {
      Check(Crc32c(scales_out.data(), scales_out.size()) == header->scales_crc32c(),
            "accepted scales that fail the header's CRC-32C");
    }
  }
  return 0;
}
