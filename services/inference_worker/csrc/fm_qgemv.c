/* Products of a few activation rows with an expert's quantized weight (common/quant.py):
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

#define FM_QGEMV_ABI 2
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
