// Job specs shared by the client tests: one bucket per published format (overrides), tensors
// whose shapes make fragments straddle shards and cut through scale blocks and tiles.
#ifndef MAINSTAY_CLIENT_SRC_TESTING_TEST_SPECS_H_
#define MAINSTAY_CLIENT_SRC_TESTING_TEST_SPECS_H_

#include <cstdint>
#include <string>

#include "absl/strings/str_cat.h"

namespace mainstay::testing_fakes {

// Every published format, D ranks, layout policy `policy`.
inline std::string AllFormatsSpec(int64_t d, const std::string& policy = "flat") {
  return absl::StrCat(R"({
    "name": "client-test",
    "recipe": "bf16_mixed",
    "data_parallel_size": )", d, R"(,
    "layout_policy": ")", policy, R"(",
    "bucket_numel": 4096,
    "overrides": [
      {"pattern": "*.mx.weight", "format": "mxfp8"},
      {"pattern": "*.fp4.weight", "format": "nvfp4"},
      {"pattern": "*.blk.weight", "format": "fp8_block"},
      {"pattern": "*.cur.weight", "format": "fp8_e4m3_current"},
      {"pattern": "*.del.weight", "format": "fp8_e4m3_delayed"}
    ],
    "tensors": [
      {"name": "layers.0.mx.weight", "shape": [64, 96]},
      {"name": "layers.0.fp4.weight", "shape": [48, 80]},
      {"name": "layers.0.blk.weight", "shape": [130, 200]},
      {"name": "layers.0.cur.weight", "shape": [33, 70]},
      {"name": "layers.0.del.weight", "shape": [20, 30]},
      {"name": "layers.0.norm.weight", "shape": [100]},
      {"name": "layers.0.bias", "shape": [77]},
      {"name": "layers.1.mx.weight", "shape": [32, 64]}
    ]
  })");
}

// A small bf16-only job: two buckets of plain tensors.
inline std::string SmallSpec(int64_t d) {
  return absl::StrCat(R"({
    "name": "client-small",
    "data_parallel_size": )", d, R"(,
    "bucket_numel": 1000,
    "tensors": [
      {"name": "w1", "shape": [30, 20]},
      {"name": "b1", "shape": [30]},
      {"name": "w2", "shape": [10, 30]},
      {"name": "b2", "shape": [10]}
    ]
  })");
}

}  // namespace mainstay::testing_fakes

#endif  // MAINSTAY_CLIENT_SRC_TESTING_TEST_SPECS_H_
