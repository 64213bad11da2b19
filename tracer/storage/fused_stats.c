/* Statistics of a float32 array in one pass: what tracer/stats.py otherwise takes in three to seven.
 *
 * For the finite values: min, max, sum and sum of squares; and the counts of NaN, +inf and -inf. Built by
 * tracer/fused.py with the machine's C compiler, without -ffast-math: NaN and the infinities must compare
 * as IEEE 754 says. GCC/Clang vector extensions give eight lanes per operation on any target (the compiler
 * lowers them to what the machine has); each lane keeps its own running values, so no sum is reordered
 * within a lane. Each block of BLOCK values is summed in float and added to double totals: a sum over
 * millions of values loses no more than one over a block does.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define WAYS 4      /* independent sets of running values */
#define BLOCK 4096 /* values per block: a multiple of 8 * WAYS */

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

typedef struct {
    double sum, sum_sq;
    float min, max; /* over the finite values; +inf and -inf when there are none */
    int64_t finite, nan, pos_inf, neg_inf;
} fused_stats;

/* Per lane, the smaller (larger) of m and b where m may be NaN and b never is; a NaN m leaves b. x86's
 * minps/maxps do exactly that in one instruction (they return the second operand when either is NaN). */
#ifdef __AVX__
#include <immintrin.h>
static inline v8f lower(v8f m, v8f b) { return (v8f)_mm256_min_ps((__m256)m, (__m256)b); }
static inline v8f higher(v8f m, v8f b) { return (v8f)_mm256_max_ps((__m256)m, (__m256)b); }
#else
static inline v8f pick(v8i mask, v8f yes, v8f no) { /* per lane: mask ? yes : no (mask lanes are 0 or -1) */
    return (v8f)(((v8i)yes & mask) | ((v8i)no & ~mask));
}
static inline v8f lower(v8f m, v8f b) { return pick(m < b, m, b); }
static inline v8f higher(v8f m, v8f b) { return pick(m > b, m, b); }
#endif

void fused_stats_f32(const float *x, int64_t n, fused_stats *out) {
    const v8f zero = {0}, inf = zero + INFINITY, ninf = zero - INFINITY;
    v8f lo[WAYS], hi[WAYS];
    for (int w = 0; w < WAYS; w++) {
        lo[w] = inf;
        hi[w] = ninf;
    }
    double sum = 0.0, sum_sq = 0.0;
    int64_t finite = 0, pos = 0, neg = 0;
    int64_t whole = n - n % (8 * WAYS), i = 0;
    while (i < whole) {
        int64_t end = i + BLOCK < whole ? i + BLOCK : whole;
        v8f s[WAYS], q[WAYS];
        v8i cf[WAYS], cp[WAYS], cm[WAYS];
        for (int w = 0; w < WAYS; w++) {
            s[w] = q[w] = zero;
            cf[w] = cp[w] = cm[w] = (v8i){0};
        }
        int64_t start = i;
        for (; i < end; i += 8 * WAYS) {
            for (int w = 0; w < WAYS; w++) { /* WAYS independent chains: no lane waits on the one before */
                v8f v;
                memcpy(&v, x + i + 8 * w, sizeof v); /* an unaligned load */
                v8f d = v - v;               /* 0 for a finite value, NaN for NaN and for either infinity */
                v8i fin = d == d;            /* -1 in the lanes of finite values, 0 elsewhere */
                v8f f = (v8f)((v8i)v & fin);
                s[w] += f;
                q[w] += f * f;
                v8f m = v + d; /* the value if finite, else NaN, which lower() and higher() skip */
                lo[w] = lower(m, lo[w]);
                hi[w] = higher(m, hi[w]);
                cf[w] -= fin; /* a true comparison is -1 in each lane */
            }
        }
        int64_t block_finite = 0;
        for (int w = 0; w < WAYS; w++) {
            for (int j = 0; j < 8; j++) {
                block_finite += cf[w][j];
            }
        }
        if (block_finite < end - start) { /* the block holds NaN or infinities: count them, while it is cached */
            for (int64_t k = start; k < end; k += 8 * WAYS) {
                for (int w = 0; w < WAYS; w++) {
                    v8f v;
                    memcpy(&v, x + k + 8 * w, sizeof v);
                    cp[w] -= v == inf;
                    cm[w] -= v == ninf;
                }
            }
        }
        finite += block_finite;
        for (int w = 0; w < WAYS; w++) {
            for (int j = 0; j < 8; j++) {
                sum += s[w][j];
                sum_sq += q[w][j];
                pos += cp[w][j];
                neg += cm[w][j];
            }
        }
    }
    float mn = INFINITY, mx = -INFINITY;
    for (int w = 0; w < WAYS; w++) {
        for (int j = 0; j < 8; j++) {
            mn = lo[w][j] < mn ? lo[w][j] : mn;
            mx = hi[w][j] > mx ? hi[w][j] : mx;
        }
    }
    for (; i < n; i++) {
        float v = x[i];
        if (v == INFINITY) {
            pos++;
        } else if (v == -INFINITY) {
            neg++;
        } else if (v == v) {
            finite++;
            sum += v;
            sum_sq += (double)v * v;
            mn = v < mn ? v : mn;
            mx = v > mx ? v : mx;
        }
    }
    out->sum = sum;
    out->sum_sq = sum_sq;
    out->min = mn;
    out->max = mx;
    out->finite = finite;
    out->pos_inf = pos;
    out->neg_inf = neg;
    out->nan = n - finite - pos - neg; /* neither finite nor infinite */
}
