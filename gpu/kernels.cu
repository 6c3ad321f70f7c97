// kvstore's CUDA kernels: page gather/scatter, int8/fp8 quantize/dequantize, RoPE re-rotation.
//
// Compiled once per device with NVRTC through cupy.RawModule (gpu/runtime.py). The source includes
// no header on purpose: NVRTC does not always find cuda_fp16.h / cuda_bf16.h / cuda_fp8.h in a
// pip-installed CUDA, so half, bfloat16 and e4m3 conversions are written out here (PTX cvt for
// half, integer rounding for bfloat16 and e4m3). Every kernel has a pure-torch `*_ref` in the
// Python module that wraps it, and the arithmetic below follows the references operation by
// operation (IEEE division, round-half-even, no FMA contraction where it would change bits) so
// that kernel and reference agree exactly.
//
// Launch shapes (chosen by the Python wrappers, which also validate every argument):
//   copy_pages_*   grid (ceil(T / rows_per_block), 2L), block (threads_per_row, rows_per_block)
//   quantize/dequantize_*  grid ceil(rows / 8), block 256: one warp per row of D elements
//   rope_rerotate_*  grid (ceil(T*H / rows_per_block), B), block (threads_per_row, rows_per_block)

typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;

// ---------------------------------------------------------------------------------------------
// Scalar formats. `storage` is the raw bit pattern in memory; load/store convert to/from float.

struct F16 {
    typedef u16 storage;
    static __device__ __forceinline__ float load(u16 h) {
        float f;
        asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
        return f;
    }
    static __device__ __forceinline__ u16 store(float f) {  // round to nearest even, like torch
        u16 h;
        asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
        return h;
    }
};

struct BF16 {
    typedef u16 storage;
    static __device__ __forceinline__ float load(u16 b) { return __uint_as_float(((u32)b) << 16); }
    static __device__ __forceinline__ u16 store(float f) {  // round to nearest even, NaN kept NaN
        u32 u = __float_as_uint(f);
        if ((u & 0x7fffffffu) > 0x7f800000u) return (u16)((u >> 16) | 0x40u);
        u += 0x7fffu + ((u >> 16) & 1u);
        return (u16)(u >> 16);
    }
};

struct F32 {
    typedef float storage;
    static __device__ __forceinline__ float load(float f) { return f; }
    static __device__ __forceinline__ float store(float f) { return f; }
};

// A non-negative float rounded *up* to bfloat16: the stored scale is never below amax / qmax, so
// |x| / scale never exceeds qmax and the int8 error stays within scale / 2 (see gpu/quant.py).
__device__ __forceinline__ u16 bf16_round_up_nonneg(float f) {
    u32 u = __float_as_uint(f);
    return (u16)((u >> 16) + ((u & 0xffffu) != 0u ? 1u : 0u));
}

// float -> e4m3fn (bias 7, max 448, no infinities), round to nearest even, saturating.
__device__ __forceinline__ unsigned char fp8_e4m3_encode(float v) {
    v = fminf(fmaxf(v, -448.0f), 448.0f);
    u32 sign = (__float_as_uint(v) >> 24) & 0x80u;
    float a = fabsf(v);
    u32 code;
    if (a < 0.015625f) {                      // below 2^-6: subnormal steps of 2^-9
        code = (u32)rintf(a * 512.0f);        // exact scaling; 8 rounds up into the first normal
    } else {
        u32 u = __float_as_uint(a);
        u += 0x7ffffu + ((u >> 20) & 1u);     // round the 23-bit mantissa to 3 bits, ties to even
        u32 exp = (u >> 23) - 127u + 7u;      // a <= 448 so the rounded value stays <= 448
        code = (exp << 3) | ((u >> 20) & 7u);
    }
    return (unsigned char)(sign | code);
}

__device__ __forceinline__ float fp8_e4m3_decode(unsigned char c) {
    u32 exp = (c >> 3) & 15u, man = c & 7u;
    float a;
    if (exp == 0u) a = (float)man * 0.001953125f;                 // man * 2^-9
    else if (exp == 15u && man == 7u) a = __uint_as_float(0x7fc00000u);  // the one NaN code
    else a = __uint_as_float(((exp + 120u) << 23) | (man << 20)); // (1 + man/8) * 2^(exp-7)
    return (c & 0x80u) ? -a : a;
}

// ---------------------------------------------------------------------------------------------
// gather / scatter between a paged KV cache and contiguous KV (L, 2, T, H, D).
//
// `page_ptrs[lk]` (lk = 2*layer + kv) points at block 0, token 0 of that layer's K or V; block b
// starts `block_stride` vectors further. This covers both engine layouts with one kernel:
//   (num_blocks, L, 2, P, H, D): page_ptrs[lk] = base + lk*P*H*D, block_stride = L*2*P*H*D
//   per-layer (num_blocks, P, H, D) lists: page_ptrs[lk] = that tensor, block_stride = P*H*D
// A row is one token's H*D elements of one (layer, kv), copied as `row_vecs` vectors of type V.

template <typename V>
__device__ __forceinline__ void copy_pages(const u64* __restrict__ page_ptrs, i64 block_stride,
                                           const i64* __restrict__ block_ids, i64 num_blocks,
                                           V* __restrict__ contig, int T, int P, int row_vecs,
                                           int to_pages) {
    const int t = blockIdx.x * blockDim.y + threadIdx.y;
    if (t >= T) return;
    const int lk = blockIdx.y;
    const i64 block = block_ids[t / P];
    if (block < 0 || block >= num_blocks) return;  // the wrapper checks; never write out of bounds
    V* paged = reinterpret_cast<V*>(page_ptrs[lk]) + block * block_stride + (i64)(t % P) * row_vecs;
    V* flat = contig + ((i64)lk * T + t) * row_vecs;
    if (to_pages) {
        for (int c = threadIdx.x; c < row_vecs; c += blockDim.x) paged[c] = flat[c];
    } else {
        for (int c = threadIdx.x; c < row_vecs; c += blockDim.x) flat[c] = paged[c];
    }
}

#define COPY_PAGES(NAME, V)                                                                      \
    extern "C" __global__ void NAME(const u64* page_ptrs, i64 block_stride, const i64* block_ids, \
                                    i64 num_blocks, V* contig, int T, int P, int row_vecs,       \
                                    int to_pages) {                                              \
        copy_pages<V>(page_ptrs, block_stride, block_ids, num_blocks, contig, T, P, row_vecs,    \
                      to_pages);                                                                 \
    }
COPY_PAGES(copy_pages_16, uint4)
COPY_PAGES(copy_pages_8, uint2)
COPY_PAGES(copy_pages_4, u32)
COPY_PAGES(copy_pages_2, u16)
COPY_PAGES(copy_pages_1, unsigned char)  // fp8 / int8 engine caches with an odd row length

// ---------------------------------------------------------------------------------------------
// quantize / dequantize: one warp per row of D elements (one token of one head of one layer's K
// or V). scale = bf16_round_up(amax / QMAX); int8: q = rint(x / scale); fp8: q = e4m3(x / scale).
// VEC elements per lane per step (4 when D % 4 == 0 and pointers allow, else 1).

struct Int8Fmt {
    static constexpr float QMAX = 127.0f;
    static __device__ __forceinline__ unsigned char encode(float v) {
        float r = fminf(fmaxf(rintf(v), -127.0f), 127.0f);
        return (unsigned char)(signed char)(int)r;
    }
    static __device__ __forceinline__ float decode(unsigned char c) { return (float)(signed char)c; }
};

struct Fp8Fmt {
    static constexpr float QMAX = 448.0f;
    static __device__ __forceinline__ unsigned char encode(float v) { return fp8_e4m3_encode(v); }
    static __device__ __forceinline__ float decode(unsigned char c) { return fp8_e4m3_decode(c); }
};

template <typename T, int VEC>
struct alignas(sizeof(T) * VEC) Pack { T v[VEC]; };

template <typename Fmt, typename S, int VEC>
__device__ __forceinline__ void quantize_rows(const typename S::storage* __restrict__ x,
                                              unsigned char* __restrict__ q,
                                              u16* __restrict__ scales, i64 rows, int D) {
    typedef typename S::storage T;
    const int lane = threadIdx.x & 31;
    const i64 row = (i64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= rows) return;  // whole warps exit together, so the shuffles below stay full-warp
    const T* xr = x + row * D;
    unsigned char* qr = q + row * D;

    float amax = 0.0f;
    for (int d = lane * VEC; d < D; d += 32 * VEC) {
        Pack<T, VEC> p = *reinterpret_cast<const Pack<T, VEC>*>(xr + d);
#pragma unroll
        for (int i = 0; i < VEC; ++i) amax = fmaxf(amax, fabsf(S::load(p.v[i])));
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));

    const u16 sbits = bf16_round_up_nonneg(amax / Fmt::QMAX);
    const float s = BF16::load(sbits);
    if (lane == 0) scales[row] = sbits;

    // Second pass re-reads the row: it is in L1, and D is not known at compile time.
    for (int d = lane * VEC; d < D; d += 32 * VEC) {
        Pack<T, VEC> p = *reinterpret_cast<const Pack<T, VEC>*>(xr + d);
        Pack<unsigned char, VEC> out;
#pragma unroll
        for (int i = 0; i < VEC; ++i) out.v[i] = Fmt::encode(s > 0.0f ? S::load(p.v[i]) / s : 0.0f);
        *reinterpret_cast<Pack<unsigned char, VEC>*>(qr + d) = out;
    }
}

template <typename Fmt, typename S, int VEC>
__device__ __forceinline__ void dequantize_rows(const unsigned char* __restrict__ q,
                                                const u16* __restrict__ scales,
                                                typename S::storage* __restrict__ x, i64 rows, int D) {
    typedef typename S::storage T;
    const int lane = threadIdx.x & 31;
    const i64 row = (i64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= rows) return;
    const float s = BF16::load(scales[row]);
    const unsigned char* qr = q + row * D;
    T* xr = x + row * D;
    for (int d = lane * VEC; d < D; d += 32 * VEC) {
        Pack<unsigned char, VEC> p = *reinterpret_cast<const Pack<unsigned char, VEC>*>(qr + d);
        Pack<T, VEC> out;
#pragma unroll
        for (int i = 0; i < VEC; ++i) out.v[i] = S::store(Fmt::decode(p.v[i]) * s);
        *reinterpret_cast<Pack<T, VEC>*>(xr + d) = out;
    }
}

#define QUANT(FMT, FMTNAME, S, SNAME, VEC)                                                          \
    extern "C" __global__ void quantize_##FMTNAME##_##SNAME##_v##VEC(                              \
        const S::storage* x, unsigned char* q, u16* scales, i64 rows, int D) {                     \
        quantize_rows<FMT, S, VEC>(x, q, scales, rows, D);                                         \
    }                                                                                              \
    extern "C" __global__ void dequantize_##FMTNAME##_##SNAME##_v##VEC(                            \
        const unsigned char* q, const u16* scales, S::storage* x, i64 rows, int D) {               \
        dequantize_rows<FMT, S, VEC>(q, scales, x, rows, D);                                       \
    }
#define QUANT_ALL(S, SNAME)                 \
    QUANT(Int8Fmt, int8, S, SNAME, 1)       \
    QUANT(Int8Fmt, int8, S, SNAME, 4)       \
    QUANT(Fp8Fmt, fp8, S, SNAME, 1)         \
    QUANT(Fp8Fmt, fp8, S, SNAME, 4)
QUANT_ALL(F16, float16)
QUANT_ALL(BF16, bfloat16)
QUANT_ALL(F32, float32)

// ---------------------------------------------------------------------------------------------
// rope_rerotate: y = R(delta_t) x for x (B, T, H, D) with rows of D contiguous and a batch
// stride (so K inside a (L, 2, T, H, D) tensor is rotated in place without a copy).
// cos/sin are (T, D/2) float32 tables the wrapper computes in float64 (angles can be large).
// neox pairs (i, i + D/2); gptj pairs (2i, 2i + 1). Explicit _rn ops: no FMA contraction, so the
// result matches the torch reference's separate multiply and add.

template <typename S>
__device__ __forceinline__ void rope_rows(const typename S::storage* x,  // may alias y: in place
                                          typename S::storage* y, i64 x_batch_stride,
                                          i64 y_batch_stride, int T, int H, int D,
                                          const float* __restrict__ cos_t,
                                          const float* __restrict__ sin_t, int neox) {
    const int row = blockIdx.x * blockDim.y + threadIdx.y;  // row = t * H + h
    if (row >= T * H) return;
    const int t = row / H, half = D / 2;
    const i64 b = blockIdx.y;
    const typename S::storage* xr = x + b * x_batch_stride + (i64)row * D;
    typename S::storage* yr = y + b * y_batch_stride + (i64)row * D;
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        const int i1 = neox ? i : 2 * i, i2 = neox ? i + half : 2 * i + 1;
        const float c = cos_t[(i64)t * half + i], s = sin_t[(i64)t * half + i];
        const float x1 = S::load(xr[i1]), x2 = S::load(xr[i2]);
        const float y1 = __fsub_rn(__fmul_rn(x1, c), __fmul_rn(x2, s));
        const float y2 = __fadd_rn(__fmul_rn(x2, c), __fmul_rn(x1, s));
        yr[i1] = S::store(y1);
        yr[i2] = S::store(y2);
    }
}

#define ROPE(S, SNAME)                                                                            \
    extern "C" __global__ void rope_rerotate_##SNAME(                                             \
        const S::storage* x, S::storage* y, i64 x_batch_stride, i64 y_batch_stride, int T, int H, \
        int D, const float* cos_t, const float* sin_t, int neox) {                                \
        rope_rows<S>(x, y, x_batch_stride, y_batch_stride, T, H, D, cos_t, sin_t, neox);          \
    }
ROPE(F16, float16)
ROPE(BF16, bfloat16)
ROPE(F32, float32)
