// Symbol visibility of libmainstay_client.
//
// The library is built with -fvisibility=hidden and a linker version script that exports only
// `mainstay::*` C++ symbols (DESIGN.md section 6, STYLE.md habit 11), so a trainer process that
// carries its own protobuf, gRPC or abseil (PyTorch) cannot bind to ours or we to theirs. Every
// out-of-line function of the public API carries MAINSTAY_CLIENT_EXPORT.
#ifndef MAINSTAY_CLIENT_EXPORT_H_
#define MAINSTAY_CLIENT_EXPORT_H_

#define MAINSTAY_CLIENT_EXPORT __attribute__((visibility("default")))

#endif  // MAINSTAY_CLIENT_EXPORT_H_
