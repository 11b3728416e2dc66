/* Decode attention read straight from the paged KV pool: one query per sequence (cpu_decode.py).
 *
 * Pool rows: [slot, Hkv, W] fp32 or bf16 values (W >= D; bf16 widened to fp32 as they are read, a
 * shift: the sums are fp32 either way), slot = table[t / bs] * bs + t % bs for key t of a
 * sequence. Query head h reads kv head h / G (G = H / Hkv). A task is one sequence, or one of
 * `splits` runs of its keys (few sequences: the runs keep every thread busy); it walks its keys in
 * order, every head of a row at once, prefetching the row AHEAD positions on (a block's rows are
 * contiguous, blocks are anywhere, and the hardware prefetchers stop at page ends). With runs, each
 * writes its share of the values' sums to `partial` [S, splits, H, D], added up at the end.
 *
 *   decode_scores   scores[s, h, t] = q[s, h, :] . K[t, h / G, :] for t < len[s], -inf up to lmax
 *   decode_values   out[s, h, :] = sum over t < len[s] of probs[s, h, t] * V[t, h / G, :]
 *
 * The softmax between the two runs in torch. The dot products' sums are reassociated for SIMD
 * (as any BLAS does), in a fixed order (`dot`); nothing else differs from the textbook loops.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

/* One call's operands. cpu_decode.py's DecodeArgs mirrors it field for field; decode_args_layout lets
 * it compare sizes and offsets once after the build, so no operand can land in another's place. */
struct decode_args {
    const float *query;                        /* [S, H, >= D]: sequences and heads strides apart */
    int64_t query_seq_stride, query_head_stride;
    const void *keys, *values;                 /* the pool's halves: [blocks * block_size, Hkv, W] */
    int64_t kv_bf16;                           /* their values: 0 fp32, 1 bf16 */
    const int64_t *tables;                     /* [S, table_width] block ids */
    int64_t table_width;
    const int64_t *lens;                       /* [S] keys of each sequence, 1..max_len */
    int64_t num_seqs, num_heads, num_kv_heads, head_dim, width, block_size, max_len, splits;
    float *scores;                             /* [S, H, max_len]: decode_scores writes */
    const float *probs;                        /* [S, H, max_len]: decode_values reads */
    float *partial;                            /* [S, splits, H, D] when splits > 1 */
    float *out;                                /* [S, H, D] */
    int64_t threads;
};

#define DECODE_ARGS_FIELDS(F) F(query) F(query_seq_stride) F(query_head_stride) F(keys) F(values) F(kv_bf16) F(tables) \
    F(table_width) F(lens) F(num_seqs) F(num_heads) F(num_kv_heads) F(head_dim) F(width) F(block_size) \
    F(max_len) F(splits) F(scores) F(probs) F(partial) F(out) F(threads)
#define PLACE(name) offsetof(struct decode_args, name), sizeof(((struct decode_args *)0)->name),

/* layout[:capacity] = [sizeof(struct decode_args), number of fields, each field's offset and size in order]. */
void decode_args_layout(int64_t *layout, int64_t capacity) {
    const int64_t places[] = {DECODE_ARGS_FIELDS(PLACE)};
    const int64_t n = sizeof(places) / sizeof(places[0]);
    if (capacity < 2) return;
    layout[0] = sizeof(struct decode_args);
    layout[1] = n / 2;
    for (int64_t i = 0; i < n && 2 + i < capacity; i++) layout[2 + i] = places[i];
}

#define AHEAD 2

static inline const char *row_at(const char *base, const int64_t *table, int64_t t, int shift, int64_t bs,
                                 int64_t row_bytes) {
    return base + (table[t >> shift] * bs + (t & (bs - 1))) * row_bytes;
}

static inline void prefetch(const char *p, int64_t bytes) {
    for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(p + b, 0, 3);
}

/* Element d of a row of fp32 (bf16 == 0) or bf16 values, as fp32. Callers pass bf16 as a constant:
 * each is inlined into a loop of its own type, vectorized (bf16: widen and shift). */
static inline __attribute__((always_inline)) float element(const char *row, int64_t d, const int bf16) {
    if (!bf16) return ((const float *)row)[d];
    union { uint32_t bits; float value; } widened = {.bits = (uint32_t)((const uint16_t *)row)[d] << 16};
    return widened.value;
}

/* q . row over d < D: LANES partial sums (d mod LANES), halved in a fixed order, then the tail: the same
 * bits for an fp32 and a bf16 row of the same values, whatever vectors the CPU has. The sums are kept
 * as two 8-lane halves: AVX2 registers (a 16-lane vector type compiled for AVX2 went through the stack,
 * up to 2.2x slower on a Zen 3); an AVX-512 CPU runs them as they are. */
#define LANES 16
typedef float f8 __attribute__((vector_size(32)));
typedef float f4 __attribute__((vector_size(16)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));
typedef uint16_t u16x8 __attribute__((vector_size(16)));

/* Elements d..d+7 of a row as fp32 (bf16: widened by a shift). */
static inline __attribute__((always_inline)) f8 eight_at(const char *row, int64_t d, const int bf16) {
    f8 x;
    if (!bf16) {
        memcpy(&x, (const float *)row + d, sizeof x);
    } else {
        u16x8 half;
        memcpy(&half, (const uint16_t *)row + d, sizeof half);
        const u32x8 bits = __builtin_convertvector(half, u32x8) << 16;
        memcpy(&x, &bits, sizeof x);
    }
    return x;
}

static inline __attribute__((always_inline)) float dot(const float *q, const char *row, int64_t D, const int bf16) {
    f8 lo = {0.f}, hi = {0.f};  /* lanes 0-7 and 8-15 */
    int64_t d = 0;
    for (; d + LANES <= D; d += LANES) {
        f8 q_lo, q_hi;
        memcpy(&q_lo, q + d, sizeof q_lo);
        memcpy(&q_hi, q + d + 8, sizeof q_hi);
        lo += q_lo * eight_at(row, d, bf16);
        hi += q_hi * eight_at(row, d + 8, bf16);
    }
    const f8 s8 = lo + hi;
    const f4 s4 = __builtin_shufflevector(s8, s8, 0, 1, 2, 3) + __builtin_shufflevector(s8, s8, 4, 5, 6, 7);
    float sum = (s4[0] + s4[2]) + (s4[1] + s4[3]);
    for (; d < D; d++) sum += q[d] * element(row, d, bf16);
    return sum;
}

/* Keys [first, end) of a sequence of `len` split into `splits` runs. */
static inline void run_of(int64_t len, int64_t splits, int64_t c, int64_t *first, int64_t *end) {
    const int64_t per = (len + splits - 1) / splits;
    *first = c * per < len ? c * per : len;
    *end = *first + per < len ? *first + per : len;
}

/* One task of decode_scores: run c of sequence s. */
static inline __attribute__((always_inline)) void score_run(const struct decode_args *a, int64_t s, int64_t c,
                                                            const int bf16) {
    const int64_t H = a->num_heads, G = H / a->num_kv_heads, D = a->head_dim, W = a->width, lmax = a->max_len;
    const int64_t bs = a->block_size, size = bf16 ? 2 : 4, row = a->num_kv_heads * W * size;
    const int64_t span = ((a->num_kv_heads - 1) * W + D) * size;
    const int shift = __builtin_ctzll(bs);
    const int64_t len = a->lens[s];
    int64_t first, end;
    run_of(len, a->splits, c, &first, &end);
    const int64_t *table = a->tables + s * a->table_width;
    const float *qs = a->query + s * a->query_seq_stride;
    const char *k = a->keys;
    float *out = a->scores + s * H * lmax;
    for (int64_t t = first; t < end; t++) {
        const char *r = row_at(k, table, t, shift, bs, row);
        if (t + AHEAD < end) prefetch(row_at(k, table, t + AHEAD, shift, bs, row), span);
        for (int64_t h = 0; h < H; h++) {
            const char *key = r + (h / G) * W * size;
            const float *qh = qs + h * a->query_head_stride;
            out[h * lmax + t] = dot(qh, key, D, bf16);
        }
    }
    if (c == a->splits - 1)
        for (int64_t h = 0; h < H; h++)
            for (int64_t t = len; t < lmax; t++) out[h * lmax + t] = -INFINITY;
}

/* One task of decode_values: run c of sequence s, into `os` [H, D]. */
static inline __attribute__((always_inline)) void value_run(const struct decode_args *a, int64_t s, int64_t c,
                                                            float *os, const int bf16) {
    const int64_t H = a->num_heads, G = H / a->num_kv_heads, D = a->head_dim, W = a->width, lmax = a->max_len;
    const int64_t bs = a->block_size, size = bf16 ? 2 : 4, row = a->num_kv_heads * W * size;
    const int64_t span = ((a->num_kv_heads - 1) * W + D) * size;
    const int shift = __builtin_ctzll(bs);
    int64_t first, end;
    run_of(a->lens[s], a->splits, c, &first, &end);
    const int64_t *table = a->tables + s * a->table_width;
    const float *ps = a->probs + s * H * lmax;
    const char *v = a->values;
    for (int64_t i = 0; i < H * D; i++) os[i] = 0.f;
    for (int64_t t = first; t < end; t++) {
        const char *r = row_at(v, table, t, shift, bs, row);
        if (t + AHEAD < end) prefetch(row_at(v, table, t + AHEAD, shift, bs, row), span);
        for (int64_t h = 0; h < H; h++) {
            const float p = ps[h * lmax + t];
            const char *value = r + (h / G) * W * size;
            float *oh = os + h * D;
#pragma omp simd
            for (int64_t d = 0; d < D; d++) oh[d] += p * element(value, d, bf16);
        }
    }
}

void decode_scores(const struct decode_args *a) {
    const int64_t S = a->num_seqs, splits = a->splits;
#pragma omp parallel for collapse(2) schedule(dynamic, 1) num_threads((int)a->threads)
    for (int64_t s = 0; s < S; s++)
        for (int64_t c = 0; c < splits; c++) {
            if (a->kv_bf16)
                score_run(a, s, c, 1);
            else
                score_run(a, s, c, 0);
        }
}

void decode_values(const struct decode_args *a) {
    const int64_t S = a->num_seqs, H = a->num_heads, D = a->head_dim, splits = a->splits;
    float *partial = a->partial, *out = a->out;
#pragma omp parallel num_threads((int)a->threads)
    {
#pragma omp for collapse(2) schedule(dynamic, 1)
        for (int64_t s = 0; s < S; s++)
            for (int64_t c = 0; c < splits; c++) {
                float *os = splits == 1 ? out + s * H * D : partial + (s * splits + c) * H * D;
                if (a->kv_bf16)
                    value_run(a, s, c, os, 1);
                else
                    value_run(a, s, c, os, 0);
            }
        if (splits > 1) {
#pragma omp for schedule(static)
            for (int64_t i = 0; i < S * H * D; i++) {
                const int64_t s = i / (H * D), j = i % (H * D);
                float sum = 0.f;
                for (int64_t c = 0; c < splits; c++) sum += partial[(s * splits + c) * H * D + j];
                out[i] = sum;
            }
        }
    }
}
