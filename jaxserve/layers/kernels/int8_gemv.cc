// int8 x int8 -> int32 products of a few rows against a weight on a CPU, as an XLA FFI custom call.
//
// Why a hand-written kernel: a decode step multiplies one to a few rows by every weight of the
// model, so it is bound by reading the weights. XLA:CPU's int8 dot refuses one row (YNNPACK) and
// its float32 dot of the widened int8 weight reads them at about 9 GB/s; this kernel streams the
// int8 weight once, in the order it is stored, at the memory's speed, with AVX-512 VNNI's
// u8 x s8 dot products (vpdpbusd); a CPU without them keeps XLA's path. The products are
// integers, exact in int32, so the result is the same bits as any other exact path (linear.py's
// _exact_int_dot): a row's tokens do not depend on which path its batch took.
//
// Shapes (row-major):
//   x       [M, K]                    int8   the rows, quantized (K a multiple of 4)
//   tiles   [L, N / 64, K / 4, 64, 4] int8   L layers' weights w [K, N], each laid out by layout():
//                                            64 output channels at a time, 4 consecutive k of a
//                                            channel together
//   offset  [L, N]                    int32  128 * sum_k w[k, n] (see below)
//   layer   []                        int32  which of the L to multiply: the whole stack is passed,
//                                            so a layer's weight is read in place, never copied
//   out     [M, N]                    int32  x @ w
// vpdpbusd multiplies unsigned by signed bytes, so each x is read as x + 128 (its top bit flipped)
// and 128 * sum_k w[k, n] is subtracted at the end: (x + 128) . w - 128 . w = x . w, exactly.

#include <cstdint>
#include <cstring>

#if !defined(__AVX512VNNI__) || !defined(__AVX512BW__)
#error "int8_gemv is written for AVX-512 VNNI (layers/cpu_gemv.py keeps XLA's path on other CPUs)"
#endif
#include <immintrin.h>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kTile = 64;  // output channels per tile: four 16-lane int32 accumulators per row

// One tile of 64 outputs for M rows: the tile's K / 4 groups of 256 bytes are read in order,
// once, each used by every row.
template <int M>
void tile_vnni(const int8_t* x, int64_t K, const int8_t* w, const int32_t* offset, int32_t* out, int64_t N) {
  __m512i acc[M][4];
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < 4; ++j) acc[m][j] = _mm512_setzero_si512();
  for (int64_t kb = 0; kb < K / 4; ++kb, w += 4 * kTile) {
    const __m512i b0 = _mm512_loadu_si512(w), b1 = _mm512_loadu_si512(w + 64);
    const __m512i b2 = _mm512_loadu_si512(w + 128), b3 = _mm512_loadu_si512(w + 192);
    for (int m = 0; m < M; ++m) {
      uint32_t four;
      std::memcpy(&four, x + m * K + 4 * kb, 4);
      const __m512i a = _mm512_set1_epi32(static_cast<int32_t>(four ^ 0x80808080u));  // x + 128, unsigned
      acc[m][0] = _mm512_dpbusd_epi32(acc[m][0], a, b0);
      acc[m][1] = _mm512_dpbusd_epi32(acc[m][1], a, b1);
      acc[m][2] = _mm512_dpbusd_epi32(acc[m][2], a, b2);
      acc[m][3] = _mm512_dpbusd_epi32(acc[m][3], a, b3);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < 4; ++j) {
      const __m512i o = _mm512_loadu_si512(offset + 16 * j);
      _mm512_storeu_si512(out + m * N + 16 * j, _mm512_sub_epi32(acc[m][j], o));
    }
}

ffi::Error Int8GemvImpl(ffi::Buffer<ffi::S8> x, ffi::Buffer<ffi::S8> tiles, ffi::Buffer<ffi::S32> offset,
                        ffi::Buffer<ffi::S32> layer_buf, ffi::ResultBuffer<ffi::S32> out) {
  const auto xd = x.dimensions(), td = tiles.dimensions(), od = offset.dimensions();
  if (xd.size() != 2 || td.size() != 5 || td[3] != kTile || td[4] != 4 || od.size() != 2) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "int8_gemv: x must be [M, K], tiles [L, N/64, K/4, 64, 4], offset [L, N]");
  }
  const int64_t L = td[0], M = xd[0], K = xd[1], N = td[1] * kTile;
  if (td[2] * 4 != K || od[0] != L || od[1] != N || M > 8) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "int8_gemv: inconsistent shapes (or more than 8 rows)");
  }
  const int64_t layer = layer_buf.typed_data()[0];
  if (layer < 0 || layer >= L) return ffi::Error(ffi::ErrorCode::kOutOfRange, "int8_gemv: layer out of range");
  const int8_t* xs = x.typed_data();
  const int8_t* ws = tiles.typed_data() + layer * N * K;
  const int32_t* os = offset.typed_data() + layer * N;
  int32_t* res = out->typed_data();
  for (int64_t t = 0; t < N / kTile; ++t) {
    const int8_t* w = ws + t * K * kTile;
    int32_t* o = res + t * kTile;
    const int32_t* off = os + t * kTile;
    switch (M) {
      case 1: tile_vnni<1>(xs, K, w, off, o, N); break;
      case 2: tile_vnni<2>(xs, K, w, off, o, N); break;
      case 3: tile_vnni<3>(xs, K, w, off, o, N); break;
      case 4: tile_vnni<4>(xs, K, w, off, o, N); break;
      case 5: tile_vnni<5>(xs, K, w, off, o, N); break;
      case 6: tile_vnni<6>(xs, K, w, off, o, N); break;
      case 7: tile_vnni<7>(xs, K, w, off, o, N); break;
      case 8: tile_vnni<8>(xs, K, w, off, o, N); break;
      default: break;
    }
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveInt8Gemv, Int8GemvImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());
