// common/grpc_chunk: the encoders write exactly protobuf's bytes for the same message, the
// decoder reads protobuf's encoding however gRPC split it into slices, and it claims nothing it
// should leave to protobuf: every message it accepts, protobuf parses to the same chunk (checked
// on random mutations), and the other messages of the streams are refused.
#include "common/grpc_chunk.h"

#include <grpcpp/support/byte_buffer.h>

#include <random>
#include <string>
#include <vector>

#include "common/crc32c.h"
#include "gtest/gtest.h"
#include "mainstay/v1/shard.pb.h"

namespace mainstay {
namespace {

std::string Flatten(const grpc::ByteBuffer& buffer) {
  std::vector<grpc::Slice> slices;
  EXPECT_TRUE(buffer.Dump(&slices).ok());
  std::string out;
  for (const grpc::Slice& s : slices) out.append(reinterpret_cast<const char*>(s.begin()), s.size());
  return out;
}

std::string Joined(const ChunkView& view) {
  std::string out;
  for (const auto piece : view.pieces) out.append(reinterpret_cast<const char*>(piece.data()), piece.size());
  return out;
}

// `bytes` as a ByteBuffer of slices cut at random places (as gRPC's reads may cut them).
grpc::ByteBuffer Sliced(const std::string& bytes, std::mt19937& rng) {
  std::vector<grpc::Slice> slices;
  size_t at = 0;
  while (at < bytes.size()) {
    const size_t n = std::min<size_t>(bytes.size() - at, 1 + rng() % 7);
    slices.emplace_back(bytes.data() + at, n);
    at += n;
  }
  if (slices.empty()) slices.emplace_back();
  return grpc::ByteBuffer(slices.data(), slices.size());
}

std::string Payload(size_t n, uint8_t seed) {
  std::string s(n, '\0');
  for (size_t i = 0; i < n; ++i) s[i] = static_cast<char>(seed + i * 7);
  return s;
}

std::span<const uint8_t> Bytes(const std::string& s) {
  return {reinterpret_cast<const uint8_t*>(s.data()), s.size()};
}

const int64_t kOffsets[] = {0, 1, 127, 128, 300, int64_t{1} << 40, -1};
const size_t kSizes[] = {0, 1, 127, 128, 4096, (size_t{1} << 20) + 3};

TEST(GrpcChunkTest, EncodersWriteProtobufsBytes) {
  for (const int64_t offset : kOffsets) {
    for (const size_t size : kSizes) {
      const std::string data = Payload(size, static_cast<uint8_t>(size));
      v1::PushGradRequest push;
      push.mutable_chunk()->set_element_offset(offset);
      push.mutable_chunk()->set_data(data);
      v1::PullParamsResponse scales;
      scales.mutable_scales()->set_scale_offset(offset);
      scales.mutable_scales()->set_data(data);
      EXPECT_EQ(Flatten(EncodeChunkCopy(2, offset, Bytes(data))), push.SerializeAsString())
          << "offset " << offset << " size " << size;
      EXPECT_EQ(Flatten(EncodeChunkShared(3, offset, Bytes(data), nullptr)), scales.SerializeAsString())
          << "offset " << offset << " size " << size;
    }
  }
}

// With a CRC to extend, the copy writes the same bytes and the CRC covers exactly the data,
// chained across chunks as the grpc transport chains a push's.
TEST(GrpcChunkTest, CopyingEncoderExtendsTheCrcOverTheData) {
  uint32_t crc = 0;
  std::string all;
  for (const size_t size : kSizes) {
    const std::string data = Payload(size, static_cast<uint8_t>(size + 1));
    v1::PushGradRequest push;
    push.mutable_chunk()->set_element_offset(static_cast<int64_t>(all.size()));
    push.mutable_chunk()->set_data(data);
    EXPECT_EQ(Flatten(EncodeChunkCopy(2, static_cast<int64_t>(all.size()), Bytes(data), &crc)),
              push.SerializeAsString())
        << "size " << size;
    all += data;
    EXPECT_EQ(crc, Crc32c(all.data(), all.size())) << "after a chunk of " << size << " bytes";
  }
}

TEST(GrpcChunkTest, SharedEncodingKeepsItsOwnerUntilGrpcLetsGo) {
  auto owner = std::make_shared<std::string>(Payload(5000, 3));
  {
    grpc::ByteBuffer message = EncodeChunkShared(2, 9, Bytes(*owner), owner);
    EXPECT_EQ(owner.use_count(), 2);
    grpc::ByteBuffer copy = message;  // gRPC shares slices the same way
    message.Clear();
    EXPECT_EQ(owner.use_count(), 2);
    ChunkView view;
    ASSERT_TRUE(DecodeChunk(copy, 2, &view));
    copy.Clear();
    EXPECT_EQ(owner.use_count(), 2);  // the view still reads it
    EXPECT_EQ(Joined(view), *owner);
  }
  EXPECT_EQ(owner.use_count(), 1);
}

TEST(GrpcChunkTest, DecodesProtobufsEncodingInAnySlicing) {
  std::mt19937 rng(7);
  for (const int64_t offset : kOffsets) {
    for (const size_t size : kSizes) {
      if (size > 5000) continue;  // slices of up to 7 bytes: keep it quick
      const std::string data = Payload(size, 1);
      v1::PullParamsResponse message;
      message.mutable_data()->set_element_offset(offset);
      message.mutable_data()->set_data(data);
      ChunkView view;
      ASSERT_TRUE(DecodeChunk(Sliced(message.SerializeAsString(), rng), 2, &view)) << offset << " " << size;
      EXPECT_EQ(view.offset, offset);
      EXPECT_EQ(view.bytes, static_cast<int64_t>(size));
      EXPECT_EQ(Joined(view), data);
      EXPECT_FALSE(DecodeChunk(Sliced(message.SerializeAsString(), rng), 3, &view)) << "another field";
    }
  }
}

TEST(GrpcChunkTest, LeavesTheOtherMessagesToProtobuf) {
  ChunkView view;
  v1::PushGradRequest header;
  header.mutable_header()->set_job_id("j");
  header.mutable_header()->set_step(4);
  std::string bytes = header.SerializeAsString();
  grpc::Slice slice(bytes.data(), bytes.size());
  EXPECT_FALSE(DecodeChunk(grpc::ByteBuffer(&slice, 1), 2, &view));

  v1::PullParamsResponse patch;
  patch.mutable_data()->set_element_offset(8);
  patch.mutable_data()->set_patch("\x01\x02");
  bytes = patch.SerializeAsString();
  slice = grpc::Slice(bytes.data(), bytes.size());
  EXPECT_FALSE(DecodeChunk(grpc::ByteBuffer(&slice, 1), 2, &view));

  // Two chunks in one message (protobuf merges them) and a chunk with bytes after it.
  v1::PushGradRequest chunk;
  chunk.mutable_chunk()->set_element_offset(4);
  chunk.mutable_chunk()->set_data("abcd");
  bytes = chunk.SerializeAsString() + chunk.SerializeAsString();
  slice = grpc::Slice(bytes.data(), bytes.size());
  EXPECT_FALSE(DecodeChunk(grpc::ByteBuffer(&slice, 1), 2, &view));
  bytes = chunk.SerializeAsString() + std::string("\x08\x01", 2);
  slice = grpc::Slice(bytes.data(), bytes.size());
  EXPECT_FALSE(DecodeChunk(grpc::ByteBuffer(&slice, 1), 2, &view));

  // Varints longer than their shortest form (a padded tag, outer length, offset or data length).
  for (const std::string& padded :
       {std::string("\x92\x80\x80\x80\x80\x00\x05\x08\x04\x12\x01\x61", 12),
        std::string("\x92\x00\x05\x08\x04\x12\x01\x61", 8),  // 2 bytes: within 5, but padded
        std::string("\x12\x85\x00\x08\x04\x12\x01\x61", 8), std::string("\x12\x06\x08\x84\x00\x12\x01\x61", 8),
        std::string("\x12\x06\x08\x04\x12\x81\x00\x61", 8)}) {
    slice = grpc::Slice(padded.data(), padded.size());
    EXPECT_FALSE(DecodeChunk(grpc::ByteBuffer(&slice, 1), 2, &view)) << "padded";
  }
  bytes = std::string("\x12\x05\x08\x04\x12\x01\x61", 7);  // the same chunk, shortest form
  slice = grpc::Slice(bytes.data(), bytes.size());
  EXPECT_TRUE(DecodeChunk(grpc::ByteBuffer(&slice, 1), 2, &view));

  // The data before the offset: valid protobuf, not the canonical form.
  bytes = std::string("\x12\x08\x12\x04", 4) + "abcd" + std::string("\x08\x04", 2);
  slice = grpc::Slice(bytes.data(), bytes.size());
  EXPECT_FALSE(DecodeChunk(grpc::ByteBuffer(&slice, 1), 2, &view));
  ASSERT_TRUE(chunk.ParseFromString(bytes));
  EXPECT_EQ(chunk.chunk().element_offset(), 4);
}

// Soundness: flip, drop and insert bytes of valid chunks; whatever the decoder accepts,
// protobuf parses to the same offset and data.
TEST(GrpcChunkTest, WhatItAcceptsProtobufReadsTheSame) {
  std::mt19937 rng(11);
  int accepted = 0;
  for (int round = 0; round < 20000; ++round) {
    v1::PushGradRequest message;
    message.mutable_chunk()->set_element_offset(static_cast<int64_t>(rng() % 1000) - 10);
    message.mutable_chunk()->set_data(Payload(rng() % 40, static_cast<uint8_t>(round)));
    std::string bytes = message.SerializeAsString();
    const int edits = 1 + static_cast<int>(rng() % 3);
    for (int e = 0; e < edits && !bytes.empty(); ++e) {
      const size_t at = rng() % bytes.size();
      switch (rng() % 3) {
        case 0: bytes[at] = static_cast<char>(rng()); break;
        case 1: bytes.erase(at, 1); break;
        default: bytes.insert(at, 1, static_cast<char>(rng())); break;
      }
    }
    ChunkView view;
    if (!DecodeChunk(Sliced(bytes, rng), 2, &view)) continue;
    ++accepted;
    v1::PushGradRequest parsed;
    ASSERT_TRUE(parsed.ParseFromString(bytes)) << round;
    ASSERT_TRUE(parsed.has_chunk()) << round;
    EXPECT_EQ(parsed.chunk().element_offset(), view.offset) << round;
    EXPECT_EQ(parsed.chunk().data(), Joined(view)) << round;
  }
  EXPECT_GT(accepted, 100);  // the mutations left some chunks valid (e.g. a changed data byte)
}

}  // namespace
}  // namespace mainstay
