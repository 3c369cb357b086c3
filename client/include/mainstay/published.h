// The published form of a pulled tensor, as a weight reader or a file writer hands it to an
// inference engine: the data tensor under the tensor's name, then its scales under the name plus
// a suffix, one convention per format (docs/weight_serving.md, "The published tensors"):
//
//   bf16 / fp16       name: the values                                          (BF16 / F16)
//   fp8 per tensor    name: E4M3 / E5M2 codes; name_scale_inv: FP32 scalar       (F8_E4M3 / F8_E5M2, F32)
//   fp8_block         name: E4M3 codes; name_scale_inv: FP32 [ceil(r/128), ceil(c/128)]
//   mxfp8             name: E4M3 codes; name_scale: E8M0 bytes [r, c/32]        (U8)
//   nvfp4             name: E2M1 codes two per byte [r, c/2] (U8), even element in the low nibble;
//                     name_scale: E4M3 [r, c/16] (each 16x16 tile's scale on its 16 rows);
//                     name_scale_2: FP32 scalar, the global decode scale
//
// dtype strings are safetensors' ("BF16", "F16", "F32", "F8_E4M3", "F8_E5M2", "U8"); bytes are
// little-endian, row-major. Thread safety: pure functions of an immutable PulledBucket.
// Errors: those of PulledBucket::Tensor (a bad index; FAILED_PRECONDITION when the bucket does
// not cover the whole tensor or came back unchanged).
#ifndef MAINSTAY_CLIENT_PUBLISHED_H_
#define MAINSTAY_CLIENT_PUBLISHED_H_

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "mainstay/export.h"
#include "mainstay/pulled.h"

namespace mainstay {

struct NamedTensor {
  std::string name;
  std::string dtype;            // safetensors dtype string
  std::vector<int64_t> shape;   // empty: a scalar
  // The bytes: a view into the PulledBucket's data (no copy; valid while any copy of that
  // PulledBucket lives), or bytes computed here (scalars, merged scale grids, dequantized values).
  std::span<const uint8_t> view;
  std::vector<uint8_t> owned;
  std::span<const uint8_t> bytes() const { return owned.empty() ? view : std::span<const uint8_t>(owned); }
};

// The published data and scales of tensor `tensor` (an index into Layout::tensors).
MAINSTAY_CLIENT_EXPORT absl::StatusOr<std::vector<NamedTensor>> PublishedTensors(const PulledBucket& bucket,
                                                                                 int32_t tensor);
// Its dequantized values as "F32", or rounded to "BF16" (round to nearest even; a bf16 tensor's
// published bits as they are), under the tensor's name.
MAINSTAY_CLIENT_EXPORT absl::StatusOr<NamedTensor> DequantizedTensor(const PulledBucket& bucket, int32_t tensor,
                                                                     bool bf16);

}  // namespace mainstay

#endif  // MAINSTAY_CLIENT_PUBLISHED_H_
