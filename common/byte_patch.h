// Byte patches, the element-level half of delta pulls (PullParamsRequest.delta_since_version,
// docs/weight_serving.md): the bytes of one chunk that differ between the reader's copy and the
// version it asks for, when that is smaller than the chunk.
//
// Encoding: a sequence of records, one per changed byte, in ascending position. A record is a
// LEB128 varint `gap` (the unchanged bytes between the previous record's byte, or the chunk's
// start, and this one) followed by the new byte. At the ~1 % of changed bytes of a small-learning-
// rate step this is 2-3 bytes per change (a bitmap would cost 1/8 of the chunk whatever changed).
//
// Thread-safe (no state).
#ifndef MAINSTAY_COMMON_BYTE_PATCH_H_
#define MAINSTAY_COMMON_BYTE_PATCH_H_

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "absl/status/status.h"

namespace mainstay {

// The patch that turns `from` into `to` (equal sizes, else nullopt), or nullopt when it would take
// `limit` bytes or more: then the chunk is better sent whole. Equal inputs give an empty patch.
std::optional<std::string> EncodeBytePatch(std::span<const uint8_t> from, std::span<const uint8_t> to, size_t limit);

// Applies `patch` to `data` in place. INVALID_ARGUMENT, naming the record, for a varint that is
// cut off or longer than 10 bytes, a record without its byte, or a position past the end of
// `data`; the records before it are applied then (patch a copy you can throw away).
absl::Status ApplyBytePatch(std::span<uint8_t> data, std::string_view patch);

}  // namespace mainstay

#endif  // MAINSTAY_COMMON_BYTE_PATCH_H_
