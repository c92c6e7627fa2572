// Decode attention over a paged KV cache on a CPU, as an XLA FFI custom call.
//
// Why a hand-written kernel: XLA:CPU runs the gather-then-multiply-reduce form of decode
// attention (jaxserve/layers/attention.py::attend_one) at 6-8 GB/s of K/V and over every slot of
// the context bucket, empty or not; at 64 streams of ~384-token contexts that was 57 % of a
// decode step of the default model. This kernel reads each sequence's pages in place through its
// block table, only up to its context length, once for K and once for V, with all of a KV head's
// query heads (GQA) sharing each key and value it loads. Work is split over (sequence, KV head)
// pairs across a small persistent thread pool.
//
// Shapes (float32, row-major):
//   q             [B, Hq, D]          this step's query per sequence, rotary already applied
//   k_cache       [L, NP, PS, K, D]   the whole cache: no slice of it is copied to call this
//   v_cache       [L, NP, PS, K, D]
//   block_tables  [B, P]  int32       pages of each sequence, in order
//   context_lens  [B]     int32       keys written for the sequence (its own token included)
//   positions     [B]     int32       the query's position (context_lens - 1 in decode)
//   layer         []      int32
//   out           [B, Hq, D]
// A key at position p is visible to the query at position q when p <= q, p < context length and,
// with the attribute sliding_window > 0, p > q - sliding_window: attend_one's mask. A sequence
// that sees no key (a padding row of the batch) gets zeros.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <sched.h>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// A fixed set of worker threads that run one parallel-for at a time beside the caller. Threads
// are made once: spawning them per call would cost more than a small layer's attention.
class Pool {
 public:
  static Pool& get() {
    static Pool pool;
    return pool;
  }

  // fn(i) for i in [0, n), spread over the workers and the calling thread.
  void parallel_for(int64_t n, const std::function<void(int64_t)>& fn) {
    if (n <= 1 || workers_.empty()) {
      for (int64_t i = 0; i < n; ++i) fn(i);
      return;
    }
    std::unique_lock<std::mutex> call(call_mu_);  // one parallel-for at a time
    {
      std::lock_guard<std::mutex> lock(mu_);
      fn_ = &fn;
      n_ = n;
      next_.store(0);
      busy_ = static_cast<int>(workers_.size());
      ++generation_;
    }
    wake_.notify_all();
    run();
    std::unique_lock<std::mutex> lock(mu_);
    done_.wait(lock, [&] { return busy_ == 0; });
    fn_ = nullptr;
  }

 private:
  Pool() {
    cpu_set_t set;
    int cpus = sched_getaffinity(0, sizeof(set), &set) == 0 ? CPU_COUNT(&set) : 1;
    for (int i = 1; i < std::max(cpus, 1); ++i) workers_.emplace_back([this] { work(); });
  }
  ~Pool() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    wake_.notify_all();
    for (auto& t : workers_) t.join();
  }

  void run() {
    for (int64_t i = next_.fetch_add(1); i < n_; i = next_.fetch_add(1)) (*fn_)(i);
  }

  void work() {
    uint64_t seen = 0;
    while (true) {
      {
        std::unique_lock<std::mutex> lock(mu_);
        wake_.wait(lock, [&] { return stop_ || generation_ != seen; });
        if (stop_) return;
        seen = generation_;
      }
      run();
      std::lock_guard<std::mutex> lock(mu_);
      if (--busy_ == 0) done_.notify_one();
    }
  }

  std::vector<std::thread> workers_;
  std::mutex call_mu_, mu_;
  std::condition_variable wake_, done_;
  const std::function<void(int64_t)>* fn_ = nullptr;
  int64_t n_ = 0;
  std::atomic<int64_t> next_{0};
  int busy_ = 0;
  uint64_t generation_ = 0;
  bool stop_ = false;
};

// Scores of one sequence's query heads against its visible keys, softmax, and the weighted sum
// of values. Each token's keys (and then values) of all KV heads are one contiguous row of
// K * D floats, read once for all Hq query heads. Templated on the head dim so the inner loops
// are fixed-length vector code (Dt = 0: any D).
template <int64_t Dt>
void attend_sequence(const float* q, const float* kc, const float* vc, const int32_t* pages, int64_t NP,
                     int64_t PS, int64_t K, int64_t G, int64_t Drt, int64_t start, int64_t end, float* out) {
  const int64_t D = Dt ? Dt : Drt, Hq = K * G, n = end - start;
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  thread_local std::vector<float> buf;
  buf.resize(Hq * n);
  float* scores = buf.data();  // [Hq, n]
  auto row = [&](const float* cache, int64_t t) {
    const int64_t page = std::clamp<int64_t>(pages[t / PS], 0, NP - 1);
    return cache + (page * PS + t % PS) * K * D;  // [K, D]
  };
  for (int64_t t = start; t < end; ++t) {
    const float* kr = row(kc, t);
    for (int64_t h = 0; h < Hq; ++h) {
      const float* kv = kr + (h / G) * D;
      const float* qh = q + h * D;
      float s = 0.f;
#pragma omp simd reduction(+ : s)
      for (int64_t d = 0; d < D; ++d) s += qh[d] * kv[d];
      scores[h * n + (t - start)] = s * scale;
    }
  }
  for (int64_t h = 0; h < Hq; ++h) {
    float* sh = scores + h * n;
    float best = -INFINITY, total = 0.f;
    for (int64_t j = 0; j < n; ++j) best = std::max(best, sh[j]);
#pragma omp simd reduction(+ : total)
    for (int64_t j = 0; j < n; ++j) {
      sh[j] = std::exp(sh[j] - best);
      total += sh[j];
    }
    const float inv = 1.0f / total;
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) sh[j] *= inv;
  }
  std::fill(out, out + Hq * D, 0.f);
  for (int64_t t = start; t < end; ++t) {
    const float* vr = row(vc, t);
    for (int64_t h = 0; h < Hq; ++h) {
      const float p = scores[h * n + (t - start)];
      const float* vv = vr + (h / G) * D;
      float* o = out + h * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) o[d] += p * vv[d];
    }
  }
}

ffi::Error PagedDecodeAttentionImpl(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_cache,
                                    ffi::Buffer<ffi::F32> v_cache, ffi::Buffer<ffi::S32> block_tables,
                                    ffi::Buffer<ffi::S32> context_lens, ffi::Buffer<ffi::S32> positions,
                                    ffi::Buffer<ffi::S32> layer_buf,
                                    ffi::ResultBuffer<ffi::F32> out, int64_t sliding_window) {
  auto qd = q.dimensions();
  auto cd = k_cache.dimensions();
  auto bd = block_tables.dimensions();
  if (qd.size() != 3 || cd.size() != 5 || bd.size() != 2 || bd[0] != qd[0] || cd[4] != qd[2] ||
      qd[1] % cd[3] != 0) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "paged_decode_attention: inconsistent shapes");
  }
  const int64_t B = qd[0], Hq = qd[1], D = qd[2];
  const int64_t L = cd[0], NP = cd[1], PS = cd[2], K = cd[3];
  const int64_t G = Hq / K, P = bd[1];
  const int64_t layer = std::clamp<int64_t>(layer_buf.typed_data()[0], 0, L - 1);
  const float* kc = k_cache.typed_data() + layer * NP * PS * K * D;
  const float* vc = v_cache.typed_data() + layer * NP * PS * K * D;
  const int32_t* cl = context_lens.typed_data();
  const int32_t* pos = positions.typed_data();
  auto attend = D == 64 ? attend_sequence<64> : D == 128 ? attend_sequence<128> : attend_sequence<0>;

  // One task per sequence: keys [start, end) of its block table's pages.
  Pool::get().parallel_for(B, [&](int64_t b) {
    float* o = out->typed_data() + b * Hq * D;
    const int64_t end = std::min<int64_t>({cl[b], int64_t{pos[b]} + 1, P * PS});
    const int64_t start = sliding_window > 0 ? std::max<int64_t>(0, int64_t{pos[b]} - sliding_window + 1) : 0;
    if (end <= start) {
      std::fill(o, o + Hq * D, 0.f);
      return;
    }
    attend(q.typed_data() + b * Hq * D, kc, vc, block_tables.typed_data() + b * P, NP, PS, K, G, D, start, end, o);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxservePagedDecodeAttention, PagedDecodeAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("sliding_window"));
