/* The predictor's one-token inference, fused: per-layer heads, skip weights and per-key bias,
 * the two heads' softmax over the distance buckets, and the five eviction estimates
 * (services/predictor/model.py: Net.step, then estimates()). One call instead of a dozen
 * numpy and torch dispatches, and the heads (the bulk of the weights) read as bfloat16 or int8
 * (per-output scales): a live predictor wakes once a token with cold caches, and then its
 * time goes to fetching those weights from memory. The numpy path in model.py is the reference; tests/unit/test_learner.py
 * checks this against it.
 *
 *   o_l        = h_l @ head_l                         h (L, D), head (L, D, 2 * B * E)
 *                (int8: (h_l @ q_l) * scale_l,       scale (L, 2 * B * E))
 *   logit[k,j] = o_l[j * E + e] + bias[j, k] + x_k @ skip[:, j]   k = l * E + e, j < 2 * B
 *   P          = softmax over the B buckets of each head (A: j < B, B: j >= B)
 *   S[0]       = L / sum_b P_A[b] inv[b] - L
 *   S[1]       = L / (sum_{b>=1} P_A[b] inv_shifted[b] / sum_{b>=1} P_A[b]) - L
 *   S[2]       = L / sum_b P_B[b] inv[b] - L
 *   S[3]       = L / (sum_{b>=1} P_B[b] inv_shifted[b] / sum_{b>=1} P_B[b]) - L
 *   S[4]       = L / (sum_{b>=2} P_A[b] inv_shifted2[b] / sum_{b>=2} P_A[b]) - L
 *   p0[k]      = P_A[0]  (the chance the key is used in the predicted token)
 *
 * Built by `flashmoe build-helper` (services/predictor/fast_infer.py). */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define FM_INFER_ABI 4
#define FM_FP32 0
#define FM_BF16 1
#define FM_INT8 2
#define MAX_BUCKETS 32

int fm_infer_abi_version(void) { return FM_INFER_ABI; }

/* work[0:O] += a * row[0:O] for each of a layer's D rows, the rows in float32, bfloat16 (the
 * high half of a float32) or int8. Plain loops: the compiler vectorizes them for whatever it
 * targets, and on x86-64 they are compiled a second time for AVX2 with FMA (Haswell and later),
 * picked at run time: one build runs anywhere and uses the wider units where they exist.
 *
 * The int8 rows are also prefetched PREFETCH_ROWS ahead. A live predictor wakes once a token
 * with its caches cold, and its hardware prefetcher starts again at every 4 KiB page of the
 * heads; asking for the rows ahead took a cold int8 call here from ~1.0 to ~0.8 ms (at bf16 the
 * same prefetch made the hot call slower, so it is left out there). */
#define PREFETCH_ROWS 4

/* One layer's products: rows (D rows of O weights, in the precision's type), with ``left``
 * weights from rows to the end of all the heads (what the prefetch may ask for). */
typedef void (*layer_products)(float *work, const float *h, const void *rows, size_t left,
                               int D, int O);

/* The three kernels of one build variant, and their table indexed by FM_FP32/BF16/INT8. */
#define LAYER_PRODUCTS(SUFFIX, ATTR)                                                          \
    ATTR static void products_f32##SUFFIX(float *work, const float *h, const void *rows_,     \
                                          size_t left, int D, int O) {                        \
        const float *rows = rows_;                                                            \
        (void)left;                                                                           \
        for (int k = 0; k < D; k++) {                                                         \
            const float a = h[k], *row = rows + (size_t)k * O;                                \
            for (int j = 0; j < O; j++) work[j] += a * row[j];                                \
        }                                                                                     \
    }                                                                                         \
    ATTR static void products_bf16##SUFFIX(float *work, const float *h, const void *rows_,    \
                                           size_t left, int D, int O) {                       \
        const uint16_t *rows = rows_;                                                         \
        (void)left;                                                                           \
        for (int k = 0; k < D; k++) {                                                         \
            const float a = h[k];                                                             \
            const uint16_t *row = rows + (size_t)k * O;                                       \
            for (int j = 0; j < O; j++) {                                                     \
                const uint32_t bits = (uint32_t)row[j] << 16;                                 \
                float w;                                                                      \
                memcpy(&w, &bits, sizeof w);                                                  \
                work[j] += a * w;                                                             \
            }                                                                                 \
        }                                                                                     \
    }                                                                                         \
    ATTR static void products_i8##SUFFIX(float *work, const float *h, const void *rows_,      \
                                         size_t left, int D, int O) {                         \
        const int8_t *rows = rows_;                                                           \
        for (int k = 0; k < D; k++) {                                                         \
            const float a = h[k];                                                             \
            const int8_t *row = rows + (size_t)k * O;                                         \
            if ((size_t)(k + PREFETCH_ROWS + 1) * O <= left) /* the row ahead exists */       \
                for (int j = 0; j < O; j += 64)                                               \
                    __builtin_prefetch(row + (size_t)PREFETCH_ROWS * O + j, 0, 0);            \
            for (int j = 0; j < O; j++) work[j] += a * (float)row[j];                         \
        }                                                                                     \
    }                                                                                         \
    static const layer_products PRODUCTS##SUFFIX[3] = {                                       \
        products_f32##SUFFIX, products_bf16##SUFFIX, products_i8##SUFFIX};

static const size_t WEIGHT_BYTES[3] = {4, 2, 1};  /* by precision */

LAYER_PRODUCTS(, )
#if defined(__x86_64__) && defined(__GNUC__)
#define HAVE_AVX2_VARIANT 1
LAYER_PRODUCTS(_avx2, __attribute__((target("avx2,fma"))))
#endif

/* e^x for x <= 0 (a softmax after its maximum is taken off), to ~2e-7 relative: 2^(x log2 e)
 * as 2^n times a degree-6 polynomial of 2^f, f in [0, 1). Inline and branch-free, so the
 * loops over a layer's experts vectorize (libm's expf does not, without -ffast-math). */
static inline float exp_nonpositive(float x) {
    float t = x * 1.44269504f;
    t = t < -126.f ? -126.f : t;
    float n = (float)(int)t;
    n -= n > t;  /* floor */
    const float f = t - n;
    float p = 1.5403530e-4f;
    p = p * f + 1.3333558e-3f;
    p = p * f + 9.6181291e-3f;
    p = p * f + 5.5504109e-2f;
    p = p * f + 2.4022651e-1f;
    p = p * f + 6.9314718e-1f;
    p = p * f + 1.0f;
    const uint32_t bits = (uint32_t)((int)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* One layer: o (2 * B * E) the heads' products, bucket-major (j * E + e). tile: 2 * B * E
 * floats of scratch, the same layout; every loop over the layer's E experts is contiguous. */
static void layer_estimates(int L, int E, int B, int F, int layer, const float *o,
                            const float *x, const float *skip, const float *bias,
                            const float *inv, const float *inv_shifted,
                            const float *inv_shifted2, float *tile, float *p0, float *S) {
    const int N = L * E, J = 2 * B;
    const size_t first = (size_t)layer * E;
    const float Lf = (float)L;
    for (int j = 0; j < J; j++) {
        const float *oj = o + (size_t)j * E, *bj = bias + (size_t)j * N + first;
        float *tj = tile + (size_t)j * E;
        for (int e = 0; e < E; e++) tj[e] = oj[e] + bj[e];
    }
    for (int e = 0; e < E; e++) {  /* + x_k @ skip, over the J outputs at once */
        float acc[2 * MAX_BUCKETS] = {0};
        const float *xk = x + (first + e) * F;
        for (int f = 0; f < F; f++) {
            const float v = xk[f], *sf = skip + (size_t)f * J;
            for (int j = 0; j < J; j++) acc[j] += v * sf[j];
        }
        for (int j = 0; j < J; j++) tile[(size_t)j * E + e] += acc[j];
    }
    for (int head = 0; head < 2; head++) {  /* softmax over the buckets, then E[1 / dist] */
        float *g = tile + (size_t)head * B * E;
        for (int e = 0; e < E; e++) {
            float top = g[e], sum = 0.f;
            for (int b = 1; b < B; b++) top = g[(size_t)b * E + e] > top ? g[(size_t)b * E + e] : top;
            for (int b = 0; b < B; b++) {
                const float v = exp_nonpositive(g[(size_t)b * E + e] - top);
                g[(size_t)b * E + e] = v;
                sum += v;
            }
            const float norm = 1.f / sum;
            float mean_inv = 0.f, tail = 0.f, tail_inv = 0.f, tail2 = 0.f, tail2_inv = 0.f;
            for (int b = 0; b < B; b++) {
                const float p = g[(size_t)b * E + e] * norm;
                mean_inv += p * inv[b];
                tail += b ? p : 0.f;
                tail_inv += p * inv_shifted[b];  /* inv_shifted[0] = 0 */
                tail2 += b > 1 ? p : 0.f;
                tail2_inv += p * inv_shifted2[b];  /* inv_shifted2[0] = [1] = 0 */
            }
            const size_t key = first + e;
            tail_inv /= tail > 1e-9f ? tail : 1e-9f;
            if (head == 0) {
                p0[key] = g[e] * norm;
                S[key] = Lf / mean_inv - Lf;
                S[(size_t)N + key] = Lf / tail_inv - Lf;
                tail2_inv /= tail2 > 1e-9f ? tail2 : 1e-9f;
                S[4 * (size_t)N + key] = Lf / tail2_inv - Lf;
            } else {
                S[2 * (size_t)N + key] = Lf / mean_inv - Lf;
                S[3 * (size_t)N + key] = Lf / tail_inv - Lf;
            }
        }
    }
}

/* precision: FM_FP32, FM_BF16 or FM_INT8 (then scale: the heads' per-output scales).
 * work: 4 * B * E floats of scratch. Returns 0, or -1 for B beyond MAX_BUCKETS or an unknown
 * precision. */
int fm_infer(int L, int E, int D, int F, int B, int precision, const float *h, const float *x,
             const float *skip, const float *bias, const void *head, const float *scale,
             const float *inv, const float *inv_shifted, const float *inv_shifted2,
             float *work, float *p0, float *S) {
    if (B < 2 || B > MAX_BUCKETS || precision < FM_FP32 || precision > FM_INT8 ||
        (precision == FM_INT8 && !scale))
        return -1;
    const int O = 2 * B * E;
    float *tile = work + O;
    const layer_products *products = PRODUCTS;
#ifdef HAVE_AVX2_VARIANT
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
        products = PRODUCTS_avx2;
#endif
    const size_t total = (size_t)L * D * O;
    for (int l = 0; l < L; l++) {
        memset(work, 0, sizeof(float) * (size_t)O);
        const size_t first = (size_t)l * D * O;
        products[precision](work, h + (size_t)l * D,
                            (const char *)head + first * WEIGHT_BYTES[precision], total - first,
                            D, O);
        if (precision == FM_INT8)
            for (int j = 0; j < O; j++) work[j] *= scale[(size_t)l * O + j];
        layer_estimates(L, E, B, F, l, work, x, skip, bias, inv, inv_shifted, inv_shifted2,
                        tile, p0, S);
    }
    return 0;
}
