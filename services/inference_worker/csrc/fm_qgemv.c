/* Products of a few activation rows with an expert's quantized weight (common/quant.py), and
 * (fm_bf16_gemv, at the end) of one row with each of a layer's native bf16 weights:
 *
 *   fm_q8_gemv  y[m, o] = scale[o] * sum_i q[o, i] * x[m, i]          q int8 [out, in]
 *   fm_q4_gemv  y[m, o] = sum_g scale[o, g] * sum_{i in g} q[o, i] * x[m, i]
 *               q packed two to a byte (q + 8, the even input in the low nibble)
 *               [out, in_pad / 2], scale float16 [out, in_pad / G], x zero-padded to in_pad
 *
 * x and y float32, M rows (a decode step's tokens of one expert: few); fm_q8_gemv_bf16 and
 * fm_q4_gemv_bf16 are the same products with x and y bfloat16 (the worker's activations,
 * widened and rounded here; x not padded). The weights are read once per call whatever M is:
 * each block of weights is widened to float32 in registers and multiplied with every row of
 * x, four output rows at a time (four independent accumulator chains hide the FMA latency at
 * M = 1).
 *
 * AVX-512 (F, BW, VL) where the CPU has it, picked at run time (__builtin_cpu_supports), so one
 * build (-O3, no -march) runs on any x86-64 and on other CPUs through the portable loops.
 * INT8 widens 16 weights with vpmovsxbd + vcvtdq2ps; INT4 turns 16 bytes (32 weights) into two
 * vectors with one vpmovzxbd, a shift, and two vpermps of a 16-entry table holding
 * (n - 8) * scale for each nibble n, which applies the group's scale too. The table lookup
 * yields the even inputs and the odd inputs as separate vectors, so x is rearranged once per
 * call to match (each 32 inputs: the 16 even ones, then the 16 odd ones).
 *
 * The next block's rows are prefetched as a block is multiplied: the weights come from RAM
 * (an expert's copy in the arena is rarely in cache), and asking ahead took a cold INT8 call
 * at [1210, 2880] from ~370 to ~290 us and an INT4 one from ~335 to ~235 us here.
 *
 * One thread: the worker shares its cores with the cache manager, the IO and the learning
 * path, and a product split over both cores waits for a scheduler tick whenever the other
 * core is busy (torch's two-thread bf16 product took ~8 ms instead of ~0.1 ms here while
 * another process held one of the two cores).
 *
 * Built by `flashmoe build-helper` (services/inference_worker/quantized.py). */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define FM_QGEMV_ABI 3
#define ROWS 4     /* output rows per block */
#define MROWS 4    /* rows of x per pass over a block */
#define CHUNK4 32  /* INT4 inputs per 16 packed bytes */

int fm_qgemv_abi_version(void) { return FM_QGEMV_ABI; }

/* IEEE half -> float, portable (normal, subnormal, zero, inf, NaN). */
static float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exponent = (h >> 10) & 0x1F, mantissa = h & 0x3FF, bits;
    if (exponent == 0x1F) {
        bits = sign | 0x7F800000u | (mantissa << 13);
    } else if (exponent) {
        bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
    } else if (mantissa) { /* subnormal: normalise */
        exponent = 113;
        while (!(mantissa & 0x400)) {
            mantissa <<= 1;
            exponent--;
        }
        bits = sign | (exponent << 23) | ((mantissa & 0x3FF) << 13);
    } else {
        bits = sign;
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* --- portable loops ------------------------------------------------------------------------ */

static void q8_portable(const int8_t *W, const float *scale, const float *x, float *y, int M,
                        int out, int in) {
    for (int o = 0; o < out; o++) {
        const int8_t *w = W + (size_t)o * in;
        for (int m = 0; m < M; m++) {
            const float *xm = x + (size_t)m * in;
            float acc = 0.f;
            for (int i = 0; i < in; i++) acc += (float)w[i] * xm[i];
            y[(size_t)m * out + o] = acc * scale[o];
        }
    }
}

static void q4_portable(const uint8_t *W, const uint16_t *scale, const float *x, float *y,
                        int M, int out, int in_pad, int G) {
    const int groups = in_pad / G;
    for (int o = 0; o < out; o++) {
        const uint8_t *w = W + (size_t)o * (in_pad / 2);
        for (int m = 0; m < M; m++) {
            const float *xm = x + (size_t)m * in_pad;
            float acc = 0.f;
            for (int g = 0; g < groups; g++) {
                float part = 0.f;
                for (int j = g * G / 2; j < (g + 1) * G / 2; j++) {
                    part += (float)((w[j] & 0xF) - 8) * xm[2 * j];
                    part += (float)((w[j] >> 4) - 8) * xm[2 * j + 1];
                }
                acc += part * half_to_float(scale[(size_t)o * groups + g]);
            }
            y[(size_t)m * out + o] = acc;
        }
    }
}

/* --- AVX-512 ------------------------------------------------------------------------------- */

#if defined(__x86_64__) && defined(__GNUC__)
#define HAVE_AVX512_VARIANT 1
#include <immintrin.h>
#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,f16c")))
#define AVX512_INLINE AVX512 __attribute__((always_inline)) static inline

/* The rows a block after o's (o's own at the end): prefetched while o's are multiplied. */
AVX512_INLINE void rows_ahead(const uint8_t *ahead[ROWS], const void *W, size_t row_bytes,
                              int out, int o, const int R) {
    for (int r = 0; r < R; r++)
        ahead[r] = (const uint8_t *)W + (size_t)(o + r + R < out ? o + r + R : o + r) * row_bytes;
}

/* acc[r][b] += W[o + r, i : i + 16] . x[m0 + b, i : i + 16], the inputs outside mask left
 * out. */
AVX512_INLINE void q8_step(__m512 acc[ROWS][MROWS], const int8_t *W, const float *x,
                           const uint8_t *ahead[ROWS], int in, int o, int m0, int i,
                           __mmask16 mask, const int R, const int MB) {
    __m512 xv[MROWS];
    for (int b = 0; b < MB; b++) xv[b] = _mm512_maskz_loadu_ps(mask, x + (size_t)(m0 + b) * in + i);
    for (int r = 0; r < R; r++) {
        if ((i & 63) == 0) _mm_prefetch((const char *)ahead[r] + i, _MM_HINT_T0);
        const __m128i bytes = _mm_maskz_loadu_epi8(mask, W + (size_t)(o + r) * in + i);
        const __m512 w = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
        for (int b = 0; b < MB; b++) acc[r][b] = _mm512_fmadd_ps(w, xv[b], acc[r][b]);
    }
}

/* Rows o .. o + R - 1 of the output for x rows m0 .. m0 + MB - 1 (R, MB constants after
 * inlining: the accumulators stay in registers). */
AVX512_INLINE void q8_block(const int8_t *W, const float *scale, const float *x, float *y,
                            int out, int in, int o, int m0, const int R, const int MB) {
    __m512 acc[ROWS][MROWS];
    for (int r = 0; r < R; r++)
        for (int b = 0; b < MB; b++) acc[r][b] = _mm512_setzero_ps();
    const uint8_t *ahead[ROWS];
    rows_ahead(ahead, W, (size_t)in, out, o, R);
    const int full = in & ~15;
    for (int i = 0; i < full; i += 16) q8_step(acc, W, x, ahead, in, o, m0, i, 0xFFFF, R, MB);
    if (full < in)
        q8_step(acc, W, x, ahead, in, o, m0, full, (__mmask16)((1u << (in - full)) - 1), R,
                MB);
    for (int r = 0; r < R; r++)
        for (int b = 0; b < MB; b++)
            y[(size_t)(m0 + b) * out + o + r] = _mm512_reduce_add_ps(acc[r][b]) * scale[o + r];
}

#define DISPATCH_MB(FN, ...)                      \
    switch (MB) {                                 \
    case 1: FN(__VA_ARGS__, 1); break;            \
    case 2: FN(__VA_ARGS__, 2); break;            \
    case 3: FN(__VA_ARGS__, 3); break;            \
    default: FN(__VA_ARGS__, 4); break;           \
    }

AVX512 static void q8_avx512(const int8_t *W, const float *scale, const float *x, float *y,
                             int M, int out, int in) {
    for (int m0 = 0; m0 < M; m0 += MROWS) {
        const int MB = M - m0 < MROWS ? M - m0 : MROWS;
        int o = 0;
        for (; o + ROWS <= out; o += ROWS)
            DISPATCH_MB(q8_block, W, scale, x, y, out, in, o, m0, ROWS)
        for (; o < out; o++) DISPATCH_MB(q8_block, W, scale, x, y, out, in, o, m0, 1)
    }
}

/* INT4, the same blocking; x here is rearranged (each 32 inputs: even ones, then odd ones). */
AVX512_INLINE void q4_block(const uint8_t *W, const uint16_t *scale, const float *x, float *y,
                            int out, int in_pad, int G, int o, int m0, const int R,
                            const int MB) {
    const __m512 levels = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
    const int groups = in_pad / G, row_bytes = in_pad / 2;
    const uint8_t *ahead[ROWS];
    rows_ahead(ahead, W, (size_t)row_bytes, out, o, R);
    __m512 acc[ROWS][MROWS];
    for (int r = 0; r < R; r++)
        for (int b = 0; b < MB; b++) acc[r][b] = _mm512_setzero_ps();
    for (int g = 0; g < groups; g++) {
        __m512 table[ROWS];
        for (int r = 0; r < R; r++)
            table[r] = _mm512_mul_ps(levels, _mm512_set1_ps(_cvtsh_ss(
                scale[(size_t)(o + r) * groups + g])));
        for (int i = g * G; i < (g + 1) * G; i += CHUNK4) {
            __m512 even[MROWS], odd[MROWS];
            for (int b = 0; b < MB; b++) {
                even[b] = _mm512_loadu_ps(x + (size_t)(m0 + b) * in_pad + i);
                odd[b] = _mm512_loadu_ps(x + (size_t)(m0 + b) * in_pad + i + 16);
            }
            for (int r = 0; r < R; r++) {
                if ((i & 127) == 0) _mm_prefetch((const char *)ahead[r] + i / 2, _MM_HINT_T0);
                const __m512i n = _mm512_cvtepu8_epi32(_mm_loadu_si128(
                    (const __m128i *)(W + (size_t)(o + r) * row_bytes + i / 2)));
                /* vpermps reads the low four bits of each index: the low nibble as is */
                const __m512 lo = _mm512_permutexvar_ps(n, table[r]);
                const __m512 hi = _mm512_permutexvar_ps(_mm512_srli_epi32(n, 4), table[r]);
                for (int b = 0; b < MB; b++) {
                    acc[r][b] = _mm512_fmadd_ps(lo, even[b], acc[r][b]);
                    acc[r][b] = _mm512_fmadd_ps(hi, odd[b], acc[r][b]);
                }
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int b = 0; b < MB; b++)
            y[(size_t)(m0 + b) * out + o + r] = _mm512_reduce_add_ps(acc[r][b]);
}

AVX512 static void q4_avx512(const uint8_t *W, const uint16_t *scale, const float *x, float *y,
                             int M, int out, int in_pad, int G) {
    for (int m0 = 0; m0 < M; m0 += MROWS) {
        const int MB = M - m0 < MROWS ? M - m0 : MROWS;
        int o = 0;
        for (; o + ROWS <= out; o += ROWS)
            DISPATCH_MB(q4_block, W, scale, x, y, out, in_pad, G, o, m0, ROWS)
        for (; o < out; o++) DISPATCH_MB(q4_block, W, scale, x, y, out, in_pad, G, o, m0, 1)
    }
}

/* Each 32 inputs of each row of x: the 16 even ones, then the 16 odd ones. */
static void deinterleave(const float *x, float *to, int M, int in_pad) {
    for (int m = 0; m < M; m++)
        for (int c = 0; c < in_pad; c += CHUNK4) {
            const float *from = x + (size_t)m * in_pad + c;
            float *dst = to + (size_t)m * in_pad + c;
            for (int k = 0; k < 16; k++) {
                dst[k] = from[2 * k];
                dst[16 + k] = from[2 * k + 1];
            }
        }
}

static int simd_state = -1; /* -1: not yet decided */

static int cpu_has_avx512(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("f16c");
}
#else
static int simd_state = 0;
static int cpu_has_avx512(void) { return 0; }
#endif

/* 1 where the AVX-512 kernels run, 0 where the portable loops do. enable: -1 asks, 0 turns
 * the AVX-512 kernels off (tests of the portable loops), 1 turns them on where the CPU has
 * them. */
int fm_qgemv_simd(int enable) {
    if (enable >= 0 || simd_state < 0) simd_state = enable != 0 && cpu_has_avx512();
    return simd_state;
}

/* Returns 0, or -1 for shapes it does not take. */
int fm_q8_gemv(const int8_t *W, const float *scale, const float *x, float *y, int M, int out,
               int in) {
    if (M < 0 || out < 0 || in < 1) return -1;
#ifdef HAVE_AVX512_VARIANT
    if (fm_qgemv_simd(-1)) {
        q8_avx512(W, scale, x, y, M, out, in);
        return 0;
    }
#endif
    q8_portable(W, scale, x, y, M, out, in);
    return 0;
}

/* Returns 0, -1 for shapes it does not take, -2 when out of memory. */
int fm_q4_gemv(const uint8_t *W, const uint16_t *scale, const float *x, float *y, int M,
               int out, int in_pad, int G) {
    if (M < 0 || out < 0 || G < 2 || G % 2 || in_pad < G || in_pad % G) return -1;
#ifdef HAVE_AVX512_VARIANT
    if (fm_qgemv_simd(-1) && G % CHUNK4 == 0) {
        float *arranged = malloc(sizeof(float) * (size_t)M * in_pad + 1);
        if (!arranged) return -2;
        deinterleave(x, arranged, M, in_pad);
        q4_avx512(W, scale, arranged, y, M, out, in_pad, G);
        free(arranged);
        return 0;
    }
#endif
    q4_portable(W, scale, x, y, M, out, in_pad, G);
    return 0;
}

/* --- bfloat16 activations ------------------------------------------------------------------ */

/* The worker's activations are bfloat16: these take x and give y in it, widening x and
 * rounding y (to nearest even, as torch converts) here, which saves the caller two tensor
 * conversions a call. The products are fm_q8_gemv's and fm_q4_gemv's: y is theirs, rounded. */

static float bf16_to_float(uint16_t b) {
    const uint32_t bits = (uint32_t)b << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static uint16_t float_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((bits >> 16) | 0x40); /* NaN */
    return (uint16_t)((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

/* x [M, in] bfloat16 -> [M, width] float32, zero-padded; then room for y [M, out]. */
static float *widen(const uint16_t *x, int M, int in, int width, int out) {
    float *buf = malloc(sizeof(float) * ((size_t)M * width + (size_t)M * out) + 1);
    if (!buf) return NULL;
    for (int m = 0; m < M; m++) {
        float *row = buf + (size_t)m * width;
        for (int i = 0; i < in; i++) row[i] = bf16_to_float(x[(size_t)m * in + i]);
        for (int i = in; i < width; i++) row[i] = 0.f;
    }
    return buf;
}

static void narrow(const float *y, uint16_t *to, size_t n) {
    for (size_t k = 0; k < n; k++) to[k] = float_to_bf16(y[k]);
}

/* fm_q8_gemv with x and y bfloat16. Returns 0, -1 for shapes it does not take, -2 when out of
 * memory. */
int fm_q8_gemv_bf16(const int8_t *W, const float *scale, const uint16_t *x, uint16_t *y, int M,
                    int out, int in) {
    if (M < 0 || out < 0 || in < 1) return -1;
    float *buf = widen(x, M, in, in, out);
    if (!buf) return -2;
    float *yf = buf + (size_t)M * in;
    const int rc = fm_q8_gemv(W, scale, buf, yf, M, out, in);
    if (rc == 0) narrow(yf, y, (size_t)M * out);
    free(buf);
    return rc;
}

/* fm_q4_gemv with x [M, in] (not padded: in <= in_pad) and y bfloat16. Returns 0, -1 for shapes
 * it does not take, -2 when out of memory. */
int fm_q4_gemv_bf16(const uint8_t *W, const uint16_t *scale, const uint16_t *x, uint16_t *y,
                    int M, int out, int in, int in_pad, int G) {
    if (M < 0 || out < 0 || in < 1 || in > in_pad) return -1;
    float *buf = widen(x, M, in, in_pad, out);
    if (!buf) return -2;
    float *yf = buf + (size_t)M * in_pad;
    const int rc = fm_q4_gemv(W, scale, buf, yf, M, out, in_pad, G);
    if (rc == 0) narrow(yf, y, (size_t)M * out);
    free(buf);
    return rc;
}

/* --- bfloat16 weights (the native experts) ------------------------------------------------- */

/* fm_bf16_gemv: n products of a bf16 row with a bf16 matrix each, a layer's experts' native
 * weights at a decode step's M = 1 (one row of x for all of them, or one row each):
 *
 *   y[j, o] = bf16(bf16(sum_i x_j[i] * W_j[i, o]) + bias_j[o])   transposed: W_j [in, out]
 *                                                                 (x @ W, GPT-OSS)
 *   y[j, o] = bf16(bf16(sum_i x_j[i] * W_j[o, i]) + bias_j[o])   else W_j [out, in] (F.linear)
 *
 * x_j = x + j * x_stride; no bias where bias or bias[j] is NULL. The sum is in float32, rounded
 * to nearest even, and the bias added to that in float32 and rounded again: torch's bf16
 * x @ W + b, but for the order of the sum (the two agree to a bf16 rounding).
 *
 * AVX-512 BF16 (vdpbf16ps: products of bf16 pairs, exact, summed in float32; a denormal input
 * reads as zero) where the CPU has it, the portable loops elsewhere. An [in, out] matrix is read
 * four rows at a time, each two rows interleaved into the (W[i, o], W[i + 1, o]) pairs
 * vdpbf16ps multiplies with (x[i], x[i + 1]), into float32 accumulators of all the outputs
 * (kept in L1); an [out, in] matrix four output rows at a time, each a dot product with x.
 *
 * At M = 1 a product is bound by its weights' bytes, read once, in place, in the order they lie.
 * Left to the hardware prefetcher, a layer's eight cold [1024, 960] and [480, 1024] products
 * read ~9 GB/s here (2.2-2.9 ms; a plain sum over the same bytes streams ~20 GB/s): the loop
 * has too many instructions a cache line for the reorder window to reach far ahead. Asking for
 * the bytes AHEAD_BYTES ahead of the reads, as one stream into L2 running on into the call's
 * next matrix, took it to 17-22 GB/s (1.1-1.4 ms); 8-32 KB ahead did the same, 4 KB less, and
 * into L1 (prefetcht0) it did not help; neither did 2 MB pages under the weights. */

#define AHEAD_BYTES 16384

static void bf16_finish_portable(const float *acc, const uint16_t *bias, uint16_t *y, int out) {
    for (int o = 0; o < out; o++) {
        const uint16_t rounded = float_to_bf16(acc[o]);
        y[o] = bias ? float_to_bf16(bf16_to_float(rounded) + bf16_to_float(bias[o])) : rounded;
    }
}

static void bf16_portable(const uint16_t *W, const uint16_t *x, const uint16_t *bias,
                          uint16_t *y, float *acc, int in, int out, int transposed) {
    for (int o = 0; o < out; o++) acc[o] = 0.f;
    if (transposed) {
        for (int i = 0; i < in; i++) {
            const float xi = bf16_to_float(x[i]);
            const uint16_t *row = W + (size_t)i * out;
            for (int o = 0; o < out; o++) acc[o] += xi * bf16_to_float(row[o]);
        }
    } else {
        for (int o = 0; o < out; o++) {
            const uint16_t *row = W + (size_t)o * in;
            for (int i = 0; i < in; i++) acc[o] += bf16_to_float(row[i]) * bf16_to_float(x[i]);
        }
    }
    bf16_finish_portable(acc, bias, y, out);
}

#ifdef HAVE_AVX512_VARIANT
#define AVX512BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
#define AVX512BF16_INLINE AVX512BF16 __attribute__((always_inline)) static inline

static int cpu_has_avx512_bf16(void) {
    __builtin_cpu_init();
    return cpu_has_avx512() && __builtin_cpu_supports("avx512bf16");
}

/* The call's matrices as one stream of bytes, prefetched AHEAD_BYTES ahead of the reads. */
typedef struct {
    const uint16_t *const *W;
    int n, next;         /* matrices; the one after at's */
    size_t bytes;        /* of each */
    uintptr_t at, end;   /* the next line to ask for; the end of its matrix */
} ahead_t;

static void ahead_start(ahead_t *a, const uint16_t *const *W, int n, size_t bytes) {
    a->W = W;
    a->n = n;
    a->next = 1;
    a->bytes = bytes;
    a->at = (uintptr_t)W[0] + AHEAD_BYTES;
    a->end = (uintptr_t)W[0] + bytes;
}

/* The next `lines` lines of the stream, asked for into L2. */
AVX512BF16_INLINE void ahead_lines(ahead_t *a, int lines) {
    for (int k = 0; k < lines; k++) {
        while (a->at >= a->end) {
            if (a->next >= a->n) return;
            const uintptr_t start = (uintptr_t)a->W[a->next++];
            a->at = start + (a->at - a->end);
            a->end = start + a->bytes;
        }
        _mm_prefetch((const char *)a->at, _MM_HINT_T1);
        a->at += 64;
    }
}

AVX512BF16_INLINE __m512 bf16x16_to_ps(__m256i v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

AVX512BF16_INLINE __mmask32 mask32(int left) {
    return left >= 32 ? 0xFFFFFFFFu : (__mmask32)((1u << left) - 1);
}

/* 16 outputs: rounded, the bias added and rounded again, the first count stored. */
AVX512BF16_INLINE void bf16_store16(uint16_t *y, const uint16_t *bias, __m512 sum, int count) {
    const __mmask16 m = count >= 16 ? 0xFFFF : (__mmask16)((1u << count) - 1);
    __m256i r = (__m256i)_mm512_cvtneps_pbh(sum);
    if (bias)
        r = (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(
            bf16x16_to_ps(r), bf16x16_to_ps(_mm256_maskz_loadu_epi16(m, bias))));
    _mm256_mask_storeu_epi16(y, m, r);
}

/* acc += the P pairs of rows from row i of an [in, out] matrix times their pairs of x; a row
 * past the last reads as zeros. Each 32 columns' accumulators are two vectors in
 * vpunpck{l,h}wd's order (see bf16_in_out). */
AVX512BF16_INLINE void bf16_row_pairs(float *acc, const uint16_t *W, const uint16_t *x, int in,
                                      int out, int i, ahead_t *ahead, const int P) {
    const uint16_t *first[2], *second[2];
    __m512bh xpair[2];
    __mmask32 has_second[2];
    for (int p = 0; p < P; p++) {
        const int a = i + 2 * p, b = a + 1 < in ? a + 1 : a;
        first[p] = W + (size_t)a * out;
        second[p] = W + (size_t)b * out;
        has_second[p] = a + 1 < in ? 0xFFFFFFFFu : 0;
        const uint32_t pair = x[a] | (a + 1 < in ? (uint32_t)x[a + 1] << 16 : 0u);
        xpair[p] = (__m512bh)_mm512_set1_epi32((int)pair);
    }
    for (int c = 0; c < out; c += 32) {
        ahead_lines(ahead, 2 * P);
        const __mmask32 m = mask32(out - c);
        __m512 lo = _mm512_load_ps(acc + c), hi = _mm512_load_ps(acc + c + 16);
        for (int p = 0; p < P; p++) {
            const __m512i ra = _mm512_maskz_loadu_epi16(m, first[p] + c);
            const __m512i rb = _mm512_maskz_loadu_epi16(m & has_second[p], second[p] + c);
            lo = _mm512_dpbf16_ps(lo, (__m512bh)_mm512_unpacklo_epi16(ra, rb), xpair[p]);
            hi = _mm512_dpbf16_ps(hi, (__m512bh)_mm512_unpackhi_epi16(ra, rb), xpair[p]);
        }
        _mm512_store_ps(acc + c, lo);
        _mm512_store_ps(acc + c + 16, hi);
    }
}

/* acc: room for out rounded up to 32 floats, 64-byte aligned. */
AVX512BF16 static void bf16_in_out(const uint16_t *W, const uint16_t *x, const uint16_t *bias,
                                   uint16_t *y, float *acc, int in, int out, ahead_t *ahead) {
    const int padded = (out + 31) & ~31;
    for (int c = 0; c < padded; c += 16) _mm512_store_ps(acc + c, _mm512_setzero_ps());
    int i = 0;
    for (; i + 4 <= in; i += 4) bf16_row_pairs(acc, W, x, in, out, i, ahead, 2);
    for (; i < in; i += 2) bf16_row_pairs(acc, W, x, in, out, i, ahead, 1);
    /* Lane k of 128-bit quarter q holds column 8q + k (lo) or 8q + 4 + k (hi). */
    const __m512i first16 = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21,
                                              22, 23);
    const __m512i second16 = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15,
                                               28, 29, 30, 31);
    for (int c = 0; c < out; c += 32) {
        const __m512 lo = _mm512_load_ps(acc + c), hi = _mm512_load_ps(acc + c + 16);
        bf16_store16(y + c, bias ? bias + c : NULL, _mm512_permutex2var_ps(lo, first16, hi),
                     out - c);
        if (out - c > 16)
            bf16_store16(y + c + 16, bias ? bias + c + 16 : NULL,
                         _mm512_permutex2var_ps(lo, second16, hi), out - c - 16);
    }
}

/* Output rows o .. o + R - 1 of an [out, in] matrix: dot products with x. */
AVX512BF16_INLINE void bf16_dots(const uint16_t *W, const uint16_t *x, float *dots, int in,
                                 int o, ahead_t *ahead, const int R) {
    __m512 acc[ROWS];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int i = 0; i < in; i += 32) {
        ahead_lines(ahead, R);
        const __mmask32 m = mask32(in - i);
        const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(m, x + i);
        for (int r = 0; r < R; r++)
            acc[r] = _mm512_dpbf16_ps(
                acc[r], (__m512bh)_mm512_maskz_loadu_epi16(m, W + (size_t)(o + r) * in + i), xv);
    }
    for (int r = 0; r < R; r++) dots[o + r] = _mm512_reduce_add_ps(acc[r]);
}

AVX512BF16 static void bf16_out_in(const uint16_t *W, const uint16_t *x, const uint16_t *bias,
                                   uint16_t *y, float *dots, int in, int out, ahead_t *ahead) {
    int o = 0;
    for (; o + ROWS <= out; o += ROWS) bf16_dots(W, x, dots, in, o, ahead, ROWS);
    for (; o < out; o++) bf16_dots(W, x, dots, in, o, ahead, 1);
    for (o = 0; o < out; o += 16)
        bf16_store16(y + o, bias ? bias + o : NULL, _mm512_loadu_ps(dots + o), out - o);
}
#else
static int cpu_has_avx512_bf16(void) { return 0; }
#endif

/* 1 where fm_bf16_gemv runs the AVX-512 BF16 kernel (fm_qgemv_simd's switch on, and the CPU
 * has it), 0 where it runs the portable loops. */
int fm_bf16_simd(void) {
    static int has = -1;
    if (has < 0) has = cpu_has_avx512_bf16();
    return fm_qgemv_simd(-1) && has;
}

/* Returns 0, -1 for shapes it does not take, -2 when out of memory. */
int fm_bf16_gemv(int n, const uint16_t *const *W, const uint16_t *const *bias, const uint16_t *x,
                 int x_stride, uint16_t *y, int out, int in, int transposed) {
    if (n < 0 || out < 1 || in < 1 || x_stride < 0) return -1;
    if (n == 0) return 0;
    /* the float32 sums of the outputs, and the vector kernels' room past them */
    float *acc = aligned_alloc(64, sizeof(float) * (size_t)((out + 31) & ~31));
    if (!acc) return -2;
#ifdef HAVE_AVX512_VARIANT
    const int simd = fm_bf16_simd();
    ahead_t ahead;
    if (simd) ahead_start(&ahead, W, n, sizeof(uint16_t) * (size_t)in * out);
#endif
    for (int j = 0; j < n; j++) {
        const uint16_t *xj = x + (size_t)j * x_stride, *bj = bias ? bias[j] : NULL;
        uint16_t *yj = y + (size_t)j * out;
#ifdef HAVE_AVX512_VARIANT
        if (simd) {
            if (transposed)
                bf16_in_out(W[j], xj, bj, yj, acc, in, out, &ahead);
            else
                bf16_out_in(W[j], xj, bj, yj, acc, in, out, &ahead);
            continue;
        }
#endif
        bf16_portable(W[j], xj, bj, yj, acc, in, out, transposed);
    }
    free(acc);
    return 0;
}
