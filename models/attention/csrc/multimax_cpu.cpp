// MultiMax attention forward on CPU in one pass over the keys: softmax(σ(q·kᵀ/√d + bias) + mask) v, with σ the
// MultiMax modulation, a block of 256 query rows against 512 keys at a time (more rows against fewer keys), so
// that a block of scores stays in the core's cache between the product that writes it and the one that reads it.
// The softmax is the online one of fused attention kernels: a row's running maximum and sum are rescaled when a
// later block raises the maximum. The backward pass (without bias or mask) recomputes each block's scores from
// the saved log-sum-exp. With σ's four weights zero, σ is the identity, which the kernel then skips: softmax attention.
//
// The matrix products call the BLAS that torch links (its Fortran interface, `sgemm_` / `dgemm_`) on raw pointers:
// at 4097 tokens one head's backward pass multiplies about 1500 pairs of blocks, and through ATen each product
// cost a dispatch and three tensor views besides. On request (`onednn`), float32 products of at least
// `kOneDnnMinProducts` multiply-adds go through oneDNN instead, by ATen's `at::native::mkldnn_matmul`, the function
// behind its own oneDNN matrix products: on CPUs where the BLAS takes a narrower vector path than the machine has,
// oneDNN multiplies these blocks about 1.8 times as fast (in blocks of 512 query rows, forward and backward), and
// below that size its per-call cost outweighs the gain.
// σ and the exponentials run in loops the compiler vectorises.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

extern "C" {
void sgemm_(const char* trans_a, const char* trans_b, const int* m, const int* n, const int* k, const float* alpha,
            const float* a, const int* lda, const float* b, const int* ldb, const float* beta, float* c,
            const int* ldc);
void dgemm_(const char* trans_a, const char* trans_b, const int* m, const int* n, const int* k, const double* alpha,
            const double* a, const int* lda, const double* b, const int* ldb, const double* beta, double* c,
            const int* ldc);
}

// result = beta·result + alpha·(mat1·mat2), in libtorch_cpu but in no installed header. Declared weak, so that a
// torch without it still loads the kernel: its address is then null, and the products stay with the BLAS.
namespace at::native {
__attribute__((weak)) void mkldnn_matmul(const at::Tensor& mat1, const at::Tensor& mat2, const at::Tensor& result,
                                         float beta, float alpha);
}

namespace {

// Products smaller than this many multiply-adds stay with the BLAS where oneDNN is requested: a 49-token window's
// scores (49·49·32) ran at a quarter of the BLAS's speed through oneDNN, a 197-token image's (197·197·64) at 1.4
// times it.
constexpr int64_t kOneDnnMinProducts = int64_t(2) << 20;

bool onednn_products_available() { return &at::native::mkldnn_matmul != nullptr; }

// Whether oneDNN's products can serve: requested, float32, and in this torch.
template <typename T>
bool onednn_usable(bool requested) {
  return requested && std::is_same_v<T, float> && onednn_products_available();
}

// Whether the products of (rows × inner) by (inner × cols) blocks go through oneDNN: usable and large enough.
// Decided once per kind of product from its full block, not per call, so that a short last block does not change
// library.
bool through_onednn(bool usable, int64_t rows, int64_t cols, int64_t inner) {
  return usable && rows * cols * inner >= kOneDnnMinProducts;
}

// A row-major (rows × cols) matrix at `data` with rows `ld` apart, or its transpose, as a tensor over the memory.
at::Tensor matrix_view(const float* data, bool transposed, int64_t rows, int64_t cols, int64_t ld) {
  const auto options = at::TensorOptions().dtype(at::kFloat);
  float* memory = const_cast<float*>(data);
  return transposed ? at::from_blob(memory, {rows, cols}, {1, ld}, options)
                    : at::from_blob(memory, {rows, cols}, {ld, 1}, options);
}

// Row-major C (m×n) = alpha·op(A)·op(B) + beta·C, op(X) = Xᵀ where `trans_x`; beta = 0 leaves C's memory unread.
// The column-major BLAS sees the row-major matrices transposed, so it computes Cᵀ = op(B)ᵀ·op(A)ᵀ. `onednn`:
// through oneDNN instead (float32 only; see `through_onednn`).
template <typename T>
void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, T alpha, const T* a, int64_t lda,
          const T* b, int64_t ldb, T beta, T* c, int64_t ldc, bool onednn) {
  const char op_a = trans_a ? 'T' : 'N', op_b = trans_b ? 'T' : 'N';
  const int rows = static_cast<int>(m), cols = static_cast<int>(n), inner = static_cast<int>(k);
  const int ld_a = static_cast<int>(lda), ld_b = static_cast<int>(ldb), ld_c = static_cast<int>(ldc);
  if constexpr (std::is_same_v<T, float>) {
    if (onednn) {
      at::native::mkldnn_matmul(matrix_view(a, trans_a, m, k, lda), matrix_view(b, trans_b, k, n, ldb),
                                matrix_view(c, false, m, n, ldc), beta, alpha);
      return;
    }
    sgemm_(&op_b, &op_a, &cols, &rows, &inner, &alpha, b, &ld_b, a, &ld_a, &beta, c, &ld_c);
  } else {
    dgemm_(&op_b, &op_a, &cols, &rows, &inner, &alpha, b, &ld_b, a, &ld_a, &beta, c, &ld_c);
  }
}

// A block of 256 query rows against 512 keys (512 KiB of float32 scores) stays in a core's L2 cache between the
// product that writes it and the one that reads it; fewer keys (short sequences) take more rows instead, for BLAS
// calls of the same size.
constexpr int64_t kQueryRows = 256;
constexpr int64_t kKeyColumns = 512;
constexpr int64_t kBlockScores = kQueryRows * kKeyColumns;
// The backward pass multiplies five pairs of matrices per block instead of two and keeps three blocks of scores:
// 128 rows (against 64 and 256, all within 3 % at 197 to 4097 tokens).
constexpr int64_t kBackwardQueryRows = 128;
// Through oneDNN, both passes take 512 rows: its products gain more from the larger blocks than the blocks lose by
// leaving the L2 cache (forward 1.08–1.10× over 256 rows at 1025 to 4097 tokens, backward 1.23–1.39× over 128 rows
// at 197 to 4097; 768 and 1024 rows no faster).
constexpr int64_t kOneDnnQueryRows = 512;

// The forward pass's block of scores for n queries against m keys, `onednn` where oneDNN's products are usable:
// (rows, columns).
std::pair<int64_t, int64_t> forward_block(int64_t n, int64_t m, bool onednn) {
  const int64_t columns = std::min(kKeyColumns, m);
  const int64_t min_rows = onednn ? kOneDnnQueryRows : kQueryRows;
  return {std::min(std::max(min_rows, kBlockScores / columns), n), columns};
}

template <typename T>
inline T positive(T x) { return x > T(0) ? x : T(0); }

// σ's breakpoints b and weights t, held by value: read through pointers, they are reloaded on every element of a
// loop that stores, since the compiler cannot rule out that the store changes them.
template <typename T>
struct Modulation {
  T b0, b1, b2, b3, t0, t1, t2, t3;
  // all four weights zero: σ(x) = x exactly (x + 0·finite), so the kernel skips it (softmax attention)
  bool identity;

  // ranges = (b0, b1, b2, b3), ts = (t0, t1, t2, t3), in any dtype
  Modulation(const at::Tensor& ranges, const at::Tensor& ts) {
    const at::Tensor b = ranges.to(c10::CppTypeToScalarType<T>::value).contiguous();
    const at::Tensor t = ts.to(c10::CppTypeToScalarType<T>::value).contiguous();
    const T *b_data = b.data_ptr<T>(), *t_data = t.data_ptr<T>();
    b0 = b_data[0]; b1 = b_data[1]; b2 = b_data[2]; b3 = b_data[3];
    t0 = t_data[0]; t1 = t_data[1]; t2 = t_data[2]; t3 = t_data[3];
    identity = t0 == T(0) && t1 == T(0) && t2 == T(0) && t3 == T(0);
  }

  // σ(x) = x + t0·max(b0 − x, 0) + t1·max(x − b1, 0) + t2·max(b2 − x, 0)² + t3·max(x − b3, 0)²
  T operator()(T x) const {
    const T below0 = positive(b0 - x), above1 = positive(x - b1);
    const T below2 = positive(b2 - x), above3 = positive(x - b3);
    return x + t0 * below0 + t1 * above1 + t2 * below2 * below2 + t3 * above3 * above3;
  }
};

// σ(s) + mask over a row of scores, in place, and the row's maximum; σ only where `kModulated`. Without σ and mask
// the row is only read: a store of the values it holds would cost a pass of writes per block.
template <typename T, bool kMasked, bool kModulated>
T modulate_row(T* row, const T* mask_row, int64_t columns, const Modulation<T> sigma) {
  T row_max = std::numeric_limits<T>::lowest();
#pragma omp simd reduction(max : row_max)
  for (int64_t j = 0; j < columns; ++j) {
    T y = kModulated ? sigma(row[j]) : row[j];
    if constexpr (kMasked) y += mask_row[j];
    if constexpr (kMasked || kModulated) row[j] = y;
    row_max = y > row_max ? y : row_max;
  }
  return row_max;
}

// Replaces a row of scores s by exp(σ(s + bias) + mask − new_max) and accumulates their sum in `row_sum`; bias and
// mask are optional (null). `row_max` goes from the previous blocks' maximum to the new one, and `row_sum` and
// `acc_row` (the output so far) are rescaled to match.
template <typename T>
void softmax_block_row(T* row, const T* bias_row, const T* mask_row, int64_t columns, const Modulation<T> sigma,
                       bool first, T& row_max, T& row_sum, T* acc_row, int64_t dv) {
  if (bias_row != nullptr) {
#pragma omp simd
    for (int64_t j = 0; j < columns; ++j) row[j] += bias_row[j];
  }
  T block_max;
  if (mask_row != nullptr) {
    block_max = sigma.identity ? modulate_row<T, true, false>(row, mask_row, columns, sigma)
                               : modulate_row<T, true, true>(row, mask_row, columns, sigma);
  } else {
    block_max = sigma.identity ? modulate_row<T, false, false>(row, mask_row, columns, sigma)
                               : modulate_row<T, false, true>(row, mask_row, columns, sigma);
  }
  const T new_max = first ? block_max : std::max(row_max, block_max);
  T block_sum = 0;
#pragma omp simd reduction(+ : block_sum)
  for (int64_t j = 0; j < columns; ++j) {
    const T e = std::exp(row[j] - new_max);
    row[j] = e;
    block_sum += e;
  }
  if (first) {
    row_sum = block_sum;
  } else {
    const T rescale = std::exp(row_max - new_max);
    row_sum = row_sum * rescale + block_sum;
    if (rescale != T(1)) {
#pragma omp simd
      for (int64_t c = 0; c < dv; ++c) acc_row[c] *= rescale;
    }
  }
  row_max = new_max;
}

// The (rows × channels) matrix of each head of a (B, h, rows, channels) tensor whose channels are adjacent, read in
// place through its strides: heads split from a (B, rows, h·channels) projection need no copy.
template <typename T>
struct HeadMatrices {
  T* data;
  int64_t heads, batch_stride, head_stride, row_stride;

  explicit HeadMatrices(const at::Tensor& x)
      : data(x.data_ptr<std::remove_const_t<T>>()), heads(x.size(1)), batch_stride(x.stride(0)),
        head_stride(x.stride(1)), row_stride(x.stride(2)) {}

  // row `row` of flat head `bh` = b·h + hh
  T* at(int64_t bh, int64_t row) const {
    return data + (bh / heads) * batch_stride + (bh % heads) * head_stride + row * row_stride;
  }
};

// The terms added to the scores of batch entry b, head hh: `bias` (B, h, n, m), read through its strides (a
// broadcast bias has zero strides), before σ; `mask` (nW, n, m), after σ, entry b taking mask[b % nW]. Either may
// be absent (undefined).
template <typename T>
struct ScoreTerms {
  std::optional<HeadMatrices<const T>> bias;
  const T* mask = nullptr;
  int64_t windows = 1, mask_window = 0, mask_row = 0;
  int64_t heads = 1;

  ScoreTerms(const at::Tensor& bias_bhnm, const at::Tensor& mask_wnm, int64_t heads) : heads(heads) {
    if (bias_bhnm.defined()) bias.emplace(bias_bhnm);
    if (mask_wnm.defined()) {
      mask = mask_wnm.data_ptr<T>();
      windows = mask_wnm.size(0); mask_window = mask_wnm.stride(0); mask_row = mask_wnm.stride(1);
    }
  }

  // Row i, from column j0, of the bias and of the mask of flat head `bh` = b·h + hh (null where absent).
  const T* bias_at(int64_t bh, int64_t i, int64_t j0) const {
    return bias.has_value() ? bias->at(bh, i) + j0 : nullptr;
  }
  const T* mask_at(int64_t bh, int64_t i, int64_t j0) const {
    return mask == nullptr ? nullptr : mask + ((bh / heads) % windows) * mask_window + i * mask_row + j0;
  }
};

// out rows `out_row_stride` apart.
template <typename T>
void normalise_rows(const T* acc, T* out, int64_t out_row_stride, T* lse, const std::vector<T>& row_max,
                    const std::vector<T>& row_sum, int64_t rows, int64_t dv) {
  for (int64_t i = 0; i < rows; ++i) {
    const T inverse = T(1) / row_sum[i];
#pragma omp simd
    for (int64_t c = 0; c < dv; ++c) out[i * out_row_stride + c] = acc[i * dv + c] * inverse;
    lse[i] = row_max[i] + std::log(row_sum[i]);
  }
}

// x as the products read it, `packed` where they go through oneDNN. The BLAS reads each head's matrix in place
// wherever channels have unit stride and rows are no closer than a row's length (q, k and v split from one
// projection are rows 3·C apart). oneDNN's product copies any block whose rows are not packed before multiplying
// it, so that a query block would be copied once for every block of keys: there, one contiguous copy of the whole
// tensor instead.
at::Tensor readable(const at::Tensor& x, bool packed) {
  if (packed) return x.contiguous();
  return x.stride(3) == 1 && x.stride(2) >= x.size(3) ? x : x.contiguous();
}

// q: (B, h, n, d), k: (B, h, m, d), v: (B, h, m, dv), out: (B, h, n, dv) with unit stride along its last
// dimension; lse: (B·h, n). The scores are scaled by `scale` = 1/√d.
template <typename T>
void forward_blocks(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out,
                    at::Tensor& lse, T scale, const Modulation<T> sigma, const ScoreTerms<T> terms, bool onednn) {
  const int64_t heads = q.size(0) * q.size(1), n = q.size(2), m = k.size(2), d = q.size(3), dv = v.size(3);
  // plain variables, not a structured binding, which the lambda below may capture only from C++20 on (earlier
  // torch releases build extensions as C++17)
  const bool usable = onednn_usable<T>(onednn);
  const std::pair<int64_t, int64_t> block = forward_block(n, m, usable);
  const int64_t rows = block.first, columns = block.second;
  const bool onednn_scores = through_onednn(usable, rows, columns, d);
  const bool onednn_values = through_onednn(usable, rows, dv, columns);
  const int64_t row_blocks = (n + rows - 1) / rows;
  const at::Tensor q_read = readable(q, usable), k_read = readable(k, usable), v_read = readable(v, usable);
  const HeadMatrices<const T> queries(q_read), keys(k_read), values(v_read);
  const HeadMatrices<T> outputs(out);
  T* lse_data = lse.data_ptr<T>();
  at::parallel_for(0, heads * row_blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> scores(rows * columns), acc(rows * dv), row_max(rows), row_sum(rows);
    for (int64_t work = begin; work < end; ++work) {
      const int64_t head = work / row_blocks, first_row = (work % row_blocks) * rows;
      const int64_t block_rows = std::min(rows, n - first_row);
      for (int64_t first_key = 0; first_key < m; first_key += columns) {
        const int64_t block_keys = std::min(columns, m - first_key);
        // the block's scores packed, block_keys apart, so that oneDNN reads and writes a ragged last block of keys
        // in place too
        gemm<T>(false, true, block_rows, block_keys, d, scale, queries.at(head, first_row), queries.row_stride,
                keys.at(head, first_key), keys.row_stride, T(0), scores.data(), block_keys, onednn_scores);
        for (int64_t i = 0; i < block_rows; ++i) {
          const int64_t row = first_row + i;
          softmax_block_row(scores.data() + i * block_keys, terms.bias_at(head, row, first_key),
                            terms.mask_at(head, row, first_key), block_keys, sigma, first_key == 0, row_max[i],
                            row_sum[i], acc.data() + i * dv, dv);
        }
        gemm<T>(false, false, block_rows, dv, block_keys, T(1), scores.data(), block_keys, values.at(head, first_key),
                values.row_stride, first_key == 0 ? T(0) : T(1), acc.data(), dv, onednn_values);
      }
      normalise_rows(acc.data(), outputs.at(head, first_row), outputs.row_stride, lse_data + head * n + first_row,
                     row_max, row_sum, block_rows, dv);
    }
  });
}

// The checks both entry points make of q.
void check_query(const char* op, const at::Tensor& q) {
  TORCH_CHECK(q.device().is_cpu() && q.dim() == 4, op, ": expected 4-d CPU tensors");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kDouble,
              op, ": expected float32 or float64, got ", q.scalar_type());
}

// The bias as (B, h, n, m) in the kernel's dtype, broadcast by strides, with unit stride along the keys.
at::Tensor bias_by_strides(const at::Tensor& bias, const at::Tensor& q, int64_t m) {
  TORCH_CHECK(bias.dim() <= 4, "multimax_forward: expected a bias of at most 4 dimensions, got ", bias.sizes());
  // made contiguous before it is broadcast, which would multiply the copy by the broadcast dimensions
  at::Tensor unbroadcast = bias.to(q.scalar_type());
  if (unbroadcast.dim() > 0 && unbroadcast.stride(-1) != 1 && unbroadcast.size(-1) != 1) {
    unbroadcast = unbroadcast.contiguous();
  }
  at::Tensor full = unbroadcast.expand({q.size(0), q.size(1), q.size(2), m});
  return full.stride(3) == 1 ? full : full.contiguous();
}

// q: (B, h, n, d), k: (B, h, m, d), v: (B, h, m, dv), ranges, ts: (4,), optional bias broadcasting to (B, h, n, m)
// and mask (nW, n, m) with B a multiple of nW -> out (B, h, n, dv), lse (B, h, n, 1).
std::vector<at::Tensor> multimax_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                         const at::Tensor& ranges, const at::Tensor& ts,
                                         const std::optional<at::Tensor>& bias,
                                         const std::optional<at::Tensor>& mask, bool onednn) {
  check_query("multimax_forward", q);
  at::NoGradGuard no_grad;
  const int64_t B = q.size(0), h = q.size(1), n = q.size(2), d = q.size(3), m = k.size(2), dv = v.size(3);
  at::Tensor bias_bhnm, mask_wnm;
  if (bias.has_value()) bias_bhnm = bias_by_strides(*bias, q, m);
  if (mask.has_value()) {
    TORCH_CHECK(mask->dim() == 3 && mask->size(1) == n && mask->size(2) == m && B % mask->size(0) == 0,
                "multimax_forward: expected a mask of shape (nW, ", n, ", ", m, ") with ", B,
                " a multiple of nW, got ", mask->sizes());
    mask_wnm = mask->to(q.scalar_type()).contiguous();
  }
  // written (B, n, h, dv), so that merging the heads back into channels is a view
  at::Tensor out = at::empty({B, n, h, dv}, q.options()).transpose(1, 2);
  at::Tensor lse = at::empty({B * h, n}, q.options());
  const double scale = std::pow(static_cast<double>(d), -0.5);
  if (q.scalar_type() == at::kDouble) {
    forward_blocks<double>(q, k, v, out, lse, scale, {ranges, ts}, {bias_bhnm, mask_wnm, h}, onednn);
  } else {
    forward_blocks<float>(q, k, v, out, lse, static_cast<float>(scale), {ranges, ts}, {bias_bhnm, mask_wnm, h},
                          onednn);
  }
  return {out, lse.view({B, h, n, 1})};
}


// Gradients of the forward pass from its output and log-sum-exp, a block of scores at a time as in the forward
// pass: each block's scores and probabilities are recomputed instead of stored. Per block (rows i, keys j):
//   P = exp(σ(S) − lse), dV += Pᵀ dO, dP = dO Vᵀ, dX = P ∘ (dP − rowsum(dO ∘ O)), dS = dX ∘ σ'(S),
//   dQ += dS K / √d, dK += dSᵀ Q / √d, and the gradients of σ's eight scalars are sums of dX times σ's partials.
// q, k, v and dO are read as the forward pass reads them (`readable`), and S is scaled the same way, so that P's
// rows are the forward pass's to the last bit; the gradients are written contiguous (B, h, ·, ·).
template <typename T>
void backward_blocks(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& grad_out,
                     const at::Tensor& lse, const at::Tensor& row_dots, at::Tensor& grad_q, at::Tensor& grad_k,
                     at::Tensor& grad_v, at::Tensor& grad_params, const Modulation<T> sigma, T scale,
                     bool onednn, bool scalar_grads) {
  // softmax attention's backward pass (σ the identity, its scalars' gradients not asked for): dS = dX
  const bool plain_softmax = sigma.identity && !scalar_grads;
  const int64_t heads = q.size(0) * q.size(1), n = q.size(2), m = k.size(2), d = q.size(3), dv = v.size(3);
  const bool usable = onednn_usable<T>(onednn);
  const int64_t rows = std::min(usable ? kOneDnnQueryRows : kBackwardQueryRows, n);
  const int64_t columns = std::min(kKeyColumns, m);
  // the scores through the forward pass's library, whose rows are then the same to the last bit
  const bool onednn_scores = through_onednn(usable, forward_block(n, m, usable).first, columns, d);
  const bool onednn_grad_probs = through_onednn(usable, rows, columns, dv);
  const bool onednn_grad_values = through_onednn(usable, columns, dv, rows);
  const bool onednn_grad_keys = through_onednn(usable, columns, d, rows);
  const bool onednn_grad_queries = through_onednn(usable, rows, d, columns);
  const at::Tensor q_read = readable(q, usable), k_read = readable(k, usable), v_read = readable(v, usable);
  const at::Tensor grad_read = readable(grad_out, usable);
  const HeadMatrices<const T> queries(q_read), keys(k_read), values(v_read), grads(grad_read);
  const HeadMatrices<T> grad_queries(grad_q), grad_keys(grad_k), grad_values(grad_v);
  const T *lse_data = lse.data_ptr<T>(), *dots_data = row_dots.data_ptr<T>();
  at::parallel_for(0, heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> scores(rows * columns), probs(rows * columns), grad_probs(rows * columns);
    for (int64_t head = begin; head < end; ++head) {
      double sums[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      const T* head_lse = lse_data + head * n;
      const T* head_dots = dots_data + head * n;
      for (int64_t first_row = 0; first_row < n; first_row += rows) {
        const int64_t block_rows = std::min(rows, n - first_row);
        const T* query_block = queries.at(head, first_row);
        const T* grad_block = grads.at(head, first_row);
        for (int64_t first_key = 0; first_key < m; first_key += columns) {
          const int64_t block_keys = std::min(columns, m - first_key);
          const T* key_block = keys.at(head, first_key);
          // blocks of scores packed, block_keys apart, as in the forward pass
          gemm<T>(false, true, block_rows, block_keys, d, scale, query_block, queries.row_stride, key_block,
                  keys.row_stride, T(0), scores.data(), block_keys, onednn_scores);
          gemm<T>(false, true, block_rows, block_keys, dv, T(1), grad_block, grads.row_stride,
                  values.at(head, first_key), values.row_stride, T(0), grad_probs.data(), block_keys,
                  onednn_grad_probs);
          for (int64_t i = 0; i < block_rows; ++i) {
            const T* s_row = scores.data() + i * block_keys;
            T* p_row = probs.data() + i * block_keys;
            T* d_row = grad_probs.data() + i * block_keys;
            const T row_lse = head_lse[first_row + i], row_dot = head_dots[first_row + i];
            // the exponentials in a loop of their own, which the compiler vectorises with its vector exp
            if (plain_softmax) {
#pragma omp simd
              for (int64_t j = 0; j < block_keys; ++j) p_row[j] = std::exp(s_row[j] - row_lse);
#pragma omp simd
              for (int64_t j = 0; j < block_keys; ++j) d_row[j] = p_row[j] * (d_row[j] - row_dot);
              continue;
            }
#pragma omp simd
            for (int64_t j = 0; j < block_keys; ++j) p_row[j] = std::exp(sigma(s_row[j]) - row_lse);
            T s0 = 0, s1 = 0, s2 = 0, s3 = 0, s4 = 0, s5 = 0, s6 = 0, s7 = 0;
            const T two_t2 = T(2) * sigma.t2, two_t3 = T(2) * sigma.t3;
#pragma omp simd reduction(+ : s0, s1, s2, s3, s4, s5, s6, s7)
            for (int64_t j = 0; j < block_keys; ++j) {
              const T x = s_row[j];
              const T below0 = positive(sigma.b0 - x), above1 = positive(x - sigma.b1);
              const T below2 = positive(sigma.b2 - x), above3 = positive(x - sigma.b3);
              const T grad_y = p_row[j] * (d_row[j] - row_dot);
              // relu's derivative is 0 at 0, as autograd takes it; selects rather than products with 0/1
              // indicators, which GCC 12 under -ffast-math compiles to scalar code
              const T grad_below0 = x < sigma.b0 ? grad_y : T(0), grad_above1 = x > sigma.b1 ? grad_y : T(0);
              // each product once, shared by dS and two sums: 1.14–1.24× the backward pass of the loop that
              // multiplied dX by σ'(S) written out
              const T grad_below2 = grad_y * below2, grad_above3 = grad_y * above3;
              d_row[j] = grad_y - two_t2 * grad_below2 + two_t3 * grad_above3 - sigma.t0 * grad_below0
                         + sigma.t1 * grad_above1;
              s0 += grad_below0;
              s1 += grad_above1;
              s2 += grad_below2;
              s3 += grad_above3;
              s4 += grad_y * below0;
              s5 += grad_y * above1;
              s6 += grad_below2 * below2;
              s7 += grad_above3 * above3;
            }
            sums[0] += s0; sums[1] += s1; sums[2] += s2; sums[3] += s3;
            sums[4] += s4; sums[5] += s5; sums[6] += s6; sums[7] += s7;
          }
          // β = 0 on a gradient's first block: it overwrites the uninitialised memory
          const T rows_beta = first_row == 0 ? T(0) : T(1), keys_beta = first_key == 0 ? T(0) : T(1);
          gemm<T>(true, false, block_keys, dv, block_rows, T(1), probs.data(), block_keys, grad_block, grads.row_stride,
                  rows_beta, grad_values.at(head, first_key), grad_values.row_stride, onednn_grad_values);
          gemm<T>(false, false, block_rows, d, block_keys, scale, grad_probs.data(), block_keys, key_block,
                  keys.row_stride, keys_beta, grad_queries.at(head, first_row), grad_queries.row_stride,
                  onednn_grad_queries);
          gemm<T>(true, false, block_keys, d, block_rows, scale, grad_probs.data(), block_keys, query_block,
                  queries.row_stride, rows_beta, grad_keys.at(head, first_key), grad_keys.row_stride, onednn_grad_keys);
        }
      }
      // ∂σ/∂b = (t0·[x < b0], −t1·[x > b1], 2t2·max(b2 − x, 0), −2t3·max(x − b3, 0)), ∂σ/∂t = the four terms
      double* g = grad_params.data_ptr<double>() + head * 8;
      g[0] = sigma.t0 * sums[0]; g[1] = -sigma.t1 * sums[1]; g[2] = 2 * sigma.t2 * sums[2];
      g[3] = -2 * sigma.t3 * sums[3];
      g[4] = sums[4]; g[5] = sums[5]; g[6] = sums[6]; g[7] = sums[7];
    }
  });
}

// Gradients of `multimax_forward` for q, k, v (their shapes) and for ranges and ts (4 each, float64); those of
// ranges and ts are zeros unless `scalar_grads`.
std::vector<at::Tensor> multimax_backward(const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k,
                                          const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
                                          const at::Tensor& ranges, const at::Tensor& ts, bool onednn,
                                          bool scalar_grads) {
  check_query("multimax_backward", q);
  at::NoGradGuard no_grad;
  const int64_t B = q.size(0), h = q.size(1), n = q.size(2), d = q.size(3), m = k.size(2), dv = v.size(3);
  const double scale = std::pow(static_cast<double>(d), -0.5);
  const at::Tensor grads = grad_out.to(q.scalar_type());
  // Σ_j P_ij dP_ij = row i of dO · O
  const at::Tensor row_dots = (grads * out).sum(-1).reshape({B * h, n}).contiguous();
  const at::Tensor row_lse = lse.reshape({B * h, n}).contiguous();
  at::Tensor grad_q = at::empty({B, h, n, d}, q.options());
  at::Tensor grad_k = at::empty({B, h, m, d}, q.options());
  at::Tensor grad_v = at::empty({B, h, m, dv}, q.options());
  at::Tensor grad_params = at::zeros({B * h, 8}, q.options().dtype(at::kDouble));
  if (q.scalar_type() == at::kDouble) {
    backward_blocks<double>(q, k, v, grads, row_lse, row_dots, grad_q, grad_k, grad_v, grad_params,
                            {ranges, ts}, scale, onednn, scalar_grads);
  } else {
    backward_blocks<float>(q, k, v, grads, row_lse, row_dots, grad_q, grad_k, grad_v, grad_params,
                           {ranges, ts}, static_cast<float>(scale), onednn, scalar_grads);
  }
  const at::Tensor params = grad_params.sum(0);
  return {grad_q, grad_k, grad_v, params.narrow(0, 0, 4).clone(), params.narrow(0, 4, 4).clone()};
}

// a·b for (B, m, k) and (B, k, n) float32 CPU tensors, through oneDNN in one call for the whole batch: the linear
// attentions' products, which torch's `bmm` gives to the BLAS (at 2.1–2.4 times the time on the CPUs where the
// BLAS takes a narrower vector path). Operands whose last two dimensions are neither packed nor transposed are
// copied by `mkldnn_matmul` first.
at::Tensor onednn_bmm(const at::Tensor& a, const at::Tensor& b) {
  TORCH_CHECK(onednn_products_available(), "onednn_bmm: this torch has no oneDNN matrix product (mkldnn_matmul)");
  TORCH_CHECK(a.device().is_cpu() && b.device().is_cpu() && a.scalar_type() == at::kFloat &&
              b.scalar_type() == at::kFloat, "onednn_bmm: expected float32 CPU tensors, got ", a.scalar_type(),
              " and ", b.scalar_type());
  TORCH_CHECK(a.dim() == 3 && b.dim() == 3 && a.size(0) == b.size(0) && a.size(2) == b.size(1),
              "onednn_bmm: expected (B, m, k) and (B, k, n), got ", a.sizes(), " and ", b.sizes());
  at::Tensor out = at::empty({a.size(0), a.size(1), b.size(2)}, a.options());
  if (out.numel() == 0) return out;
  if (a.size(2) == 0) return out.zero_();
  at::native::mkldnn_matmul(a, b, out, 0.0f, 1.0f);
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.def("multimax_forward", &multimax_forward, "MultiMax attention forward on CPU: (out, lse)");
  module.def("multimax_backward", &multimax_backward, "its gradients: (grad_q, grad_k, grad_v, grad_ranges, grad_ts)");
  module.def("onednn_bmm", &onednn_bmm, "a·b for (B, m, k) and (B, k, n) float32 tensors through oneDNN");
  module.def("onednn_products_available", &onednn_products_available,
             "whether this torch has the oneDNN matrix product that `onednn` calls");
}
