#include "common/byte_patch.h"

#include <cstring>

#include "absl/strings/str_cat.h"

namespace mainstay {
namespace {

void PutVarint(std::string& out, uint64_t v) {
  while (v >= 0x80) {
    out.push_back(static_cast<char>(static_cast<uint8_t>(v) | 0x80));
    v >>= 7;
  }
  out.push_back(static_cast<char>(v));
}

}  // namespace

std::optional<std::string> EncodeBytePatch(std::span<const uint8_t> from, std::span<const uint8_t> to, size_t limit) {
  if (from.size() != to.size()) return std::nullopt;
  std::string out;
  const size_t n = to.size();
  size_t next = 0;  // the first position the next record's gap counts from
  size_t i = 0;
  while (i < n) {
    // Skip equal 8-byte words: changes are sparse.
    if (i + 8 <= n) {
      uint64_t a, b;
      std::memcpy(&a, from.data() + i, 8);
      std::memcpy(&b, to.data() + i, 8);
      if (a == b) {
        i += 8;
        continue;
      }
    }
    if (from[i] != to[i]) {
      PutVarint(out, i - next);
      out.push_back(static_cast<char>(to[i]));
      if (out.size() >= limit) return std::nullopt;
      next = i + 1;
    }
    ++i;
  }
  return out;
}

absl::Status ApplyBytePatch(std::span<uint8_t> data, std::string_view patch) {
  size_t pos = 0;  // where the next record's gap counts from
  size_t at = 0;   // the next patch byte
  for (int64_t record = 0; at < patch.size(); ++record) {
    uint64_t gap = 0;
    int shift = 0;
    for (;;) {
      if (at == patch.size()) {
        return absl::InvalidArgumentError(absl::StrCat("byte patch record ", record, ": its gap is cut off"));
      }
      if (shift > 63) {
        return absl::InvalidArgumentError(absl::StrCat("byte patch record ", record, ": a gap of over 10 bytes"));
      }
      const auto byte = static_cast<uint8_t>(patch[at++]);
      gap |= static_cast<uint64_t>(byte & 0x7F) << shift;
      shift += 7;
      if ((byte & 0x80) == 0) break;
    }
    if (at == patch.size()) {
      return absl::InvalidArgumentError(absl::StrCat("byte patch record ", record, ": no byte after its gap"));
    }
    if (pos >= data.size() || gap >= data.size() - pos) {
      return absl::InvalidArgumentError(absl::StrCat("byte patch record ", record, ": position past the chunk's ",
                                                     data.size(), " bytes"));
    }
    pos += gap;
    data[pos++] = static_cast<uint8_t>(patch[at++]);
  }
  return absl::OkStatus();
}

}  // namespace mainstay
