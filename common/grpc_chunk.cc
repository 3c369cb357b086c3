#include "common/grpc_chunk.h"

#include <grpc/slice.h>

#include <algorithm>
#include <array>
#include <cstdlib>
#include <cstring>
#include <utility>

#include "common/crc32c.h"

namespace mainstay {
namespace {

constexpr int kMaxVarint = 10;
constexpr int kMaxFraming = 3 * (1 + kMaxVarint);  // outer tag + length, offset tag + value, data tag + length
// A tag or a length as protobuf reads it: a 32-bit varint, at most 5 bytes.
constexpr int kMaxVarint32 = 5;

int PutVarint(uint64_t v, uint8_t* out) {
  int n = 0;
  while (v >= 0x80) {
    out[n++] = static_cast<uint8_t>(v | 0x80);
    v >>= 7;
  }
  out[n++] = static_cast<uint8_t>(v);
  return n;
}

int VarintSize(uint64_t v) {
  int n = 1;
  while (v >= 0x80) {
    v >>= 7;
    ++n;
  }
  return n;
}

// The bytes before the data: what protobuf writes for Outer{field: Chunk{offset, data}}, whose
// proto3 fields are left out when they hold their default (0, empty).
int Framing(int field, int64_t offset, size_t data_bytes, uint8_t* out) {
  // kMaxFraming counts one byte for the outer tag.
  if (field < 1 || field > 15) std::abort();
  const auto offset_bits = static_cast<uint64_t>(offset);
  uint64_t inner = 0;
  if (offset_bits != 0) inner += 1 + VarintSize(offset_bits);
  if (data_bytes != 0) inner += 1 + VarintSize(data_bytes) + data_bytes;
  int n = PutVarint((static_cast<uint64_t>(field) << 3) | 2, out);
  n += PutVarint(inner, out + n);
  if (offset_bits != 0) {
    out[n++] = (1 << 3) | 0;
    n += PutVarint(offset_bits, out + n);
  }
  if (data_bytes != 0) {
    out[n++] = (2 << 3) | 2;
    n += PutVarint(data_bytes, out + n);
  }
  return n;
}

// Reads a message spread over slices, byte by byte for the framing and as pieces for the data.
class SliceReader {
 public:
  explicit SliceReader(const std::vector<grpc::Slice>& slices) : slices_(slices) {
    for (const grpc::Slice& s : slices_) remaining_ += s.size();
    Skip();
  }

  bool done() const { return index_ == slices_.size(); }
  uint64_t remaining() const { return remaining_; }

  bool Byte(uint8_t* b) {
    if (done()) return false;
    *b = slices_[index_].begin()[at_];
    Advance(1);
    return true;
  }
  // A varint of at most `max_bytes` bytes in its shortest form, as protobuf writes it: padded
  // forms (a last byte of 0) and bits past 64 are refused, whatever protobuf would make of them.
  bool Varint(uint64_t* v, int max_bytes = kMaxVarint) {
    *v = 0;
    for (int i = 0; i < max_bytes; ++i) {
      uint8_t b = 0;
      if (!Byte(&b)) return false;
      *v |= static_cast<uint64_t>(b & 0x7f) << (7 * i);
      if ((b & 0x80) == 0) return (i == 0 || b != 0) && (i < kMaxVarint - 1 || b <= 1);
    }
    return false;
  }
  // The next `n` bytes as pieces of the slices.
  bool Take(uint64_t n, std::vector<std::span<const uint8_t>>* pieces) {
    if (n > remaining_) return false;
    while (n > 0) {
      const size_t here = std::min<uint64_t>(n, slices_[index_].size() - at_);
      pieces->emplace_back(slices_[index_].begin() + at_, here);
      Advance(here);
      n -= here;
    }
    return true;
  }
 private:
  void Advance(size_t n) {
    at_ += n;
    remaining_ -= n;
    Skip();
  }
  void Skip() {  // past the end of this slice (and any empty ones)
    while (index_ < slices_.size() && at_ >= slices_[index_].size()) {
      at_ = 0;
      ++index_;
    }
  }

  const std::vector<grpc::Slice>& slices_;
  size_t index_ = 0;
  size_t at_ = 0;
  uint64_t remaining_ = 0;
};

void ReleaseOwner(void* owner) { delete static_cast<std::shared_ptr<const void>*>(owner); }

}  // namespace

grpc::ByteBuffer EncodeChunkCopy(int field, int64_t offset, std::span<const uint8_t> data, uint32_t* crc32c) {
  std::array<uint8_t, kMaxFraming> framing;
  const int n = Framing(field, offset, data.size(), framing.data());
  grpc_slice slice = grpc_slice_malloc(static_cast<size_t>(n) + data.size());
  uint8_t* out = GRPC_SLICE_START_PTR(slice);
  std::memcpy(out, framing.data(), static_cast<size_t>(n));
  if (crc32c != nullptr) {
    *crc32c = Crc32cCopyExtend(*crc32c, out + n, data.data(), data.size());
  } else if (!data.empty()) {
    std::memcpy(out + n, data.data(), data.size());
  }
  grpc::Slice owned(slice, grpc::Slice::STEAL_REF);
  return grpc::ByteBuffer(&owned, 1);
}

grpc::ByteBuffer EncodeChunkShared(int field, int64_t offset, std::span<const uint8_t> data,
                                   std::shared_ptr<const void> owner) {
  std::array<uint8_t, kMaxFraming> framing;
  const int n = Framing(field, offset, data.size(), framing.data());
  if (data.empty()) {
    grpc::Slice head(framing.data(), static_cast<size_t>(n));
    return grpc::ByteBuffer(&head, 1);
  }
  const std::array<grpc::Slice, 2> slices = {
      grpc::Slice(framing.data(), static_cast<size_t>(n)),  // copied
      grpc::Slice(const_cast<uint8_t*>(data.data()), data.size(), ReleaseOwner,
                  new std::shared_ptr<const void>(std::move(owner))),
  };
  return grpc::ByteBuffer(slices.data(), slices.size());
}

namespace {

bool DecodeInto(const grpc::ByteBuffer& buffer, int field, ChunkView* out) {
  if (!buffer.Dump(&out->slices).ok()) return false;
  SliceReader in(out->slices);
  uint64_t tag = 0;
  uint64_t length = 0;
  if (!in.Varint(&tag, kMaxVarint32) || tag != ((static_cast<uint64_t>(field) << 3) | 2)) return false;
  if (!in.Varint(&length, kMaxVarint32) || length != in.remaining()) return false;  // nothing after the chunk
  if (in.done()) return true;                                           // an empty chunk
  uint8_t next = 0;
  if (!in.Byte(&next)) return false;
  if (next == ((1 << 3) | 0)) {
    uint64_t offset = 0;
    if (!in.Varint(&offset)) return false;
    out->offset = static_cast<int64_t>(offset);
    if (in.done()) return true;
    if (!in.Byte(&next)) return false;
  }
  uint64_t bytes = 0;
  if (next != ((2 << 3) | 2) || !in.Varint(&bytes, kMaxVarint32) || bytes != in.remaining()) return false;
  if (!in.Take(bytes, &out->pieces)) return false;
  out->bytes = static_cast<int64_t>(bytes);
  return in.done();
}

}  // namespace

bool DecodeChunk(const grpc::ByteBuffer& buffer, int field, ChunkView* out) {
  out->Release();
  if (DecodeInto(buffer, field, out)) return true;
  out->Release();
  return false;
}

}  // namespace mainstay
