/* Decode attention read straight from the paged KV pool: one query per sequence (cpu_decode.py).
 *
 * Pool rows: [slot, Hkv, W] floats (W >= D), slot = table[t / bs] * bs + t % bs for key t of a
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
 * (as any BLAS does); nothing else differs from the textbook loops.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>

/* One call's operands. cpu_decode.py's DecodeArgs mirrors it field for field; decode_args_layout lets
 * it compare sizes and offsets once after the build, so no operand can land in another's place. */
struct decode_args {
    const float *query;                        /* [S, H, >= D]: sequences and heads strides apart */
    int64_t query_seq_stride, query_head_stride;
    const float *keys, *values;                /* the pool's halves: [blocks * block_size, Hkv, W] */
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

#define DECODE_ARGS_FIELDS(F) F(query) F(query_seq_stride) F(query_head_stride) F(keys) F(values) F(tables) \
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

static inline const float *row_at(const float *base, const int64_t *table, int64_t t, int shift, int64_t bs,
                                  int64_t row_floats) {
    return base + (table[t >> shift] * bs + (t & (bs - 1))) * row_floats;
}

static inline void prefetch(const float *p, int64_t bytes) {
    for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch((const char *)p + b, 0, 3);
}

/* Keys [first, end) of a sequence of `len` split into `splits` runs. */
static inline void run_of(int64_t len, int64_t splits, int64_t c, int64_t *first, int64_t *end) {
    const int64_t per = (len + splits - 1) / splits;
    *first = c * per < len ? c * per : len;
    *end = *first + per < len ? *first + per : len;
}

void decode_scores(const struct decode_args *a) {
    const float *q = a->query, *k = a->keys;
    const int64_t *tables = a->tables, *lens = a->lens;
    const int64_t q_stride_s = a->query_seq_stride, q_stride_h = a->query_head_stride, table_stride = a->table_width;
    const int64_t S = a->num_seqs, H = a->num_heads, Hkv = a->num_kv_heads, D = a->head_dim, W = a->width;
    const int64_t bs = a->block_size, lmax = a->max_len, splits = a->splits;
    float *scores = a->scores;
    const int threads = (int)a->threads;
    const int64_t G = H / Hkv, row = Hkv * W, span = ((Hkv - 1) * W + D) * (int64_t)sizeof(float);
    const int shift = __builtin_ctzll(bs);
#pragma omp parallel for collapse(2) schedule(dynamic, 1) num_threads(threads)
    for (int64_t s = 0; s < S; s++) {
        for (int64_t c = 0; c < splits; c++) {
            const int64_t len = lens[s];
            int64_t first, end;
            run_of(len, splits, c, &first, &end);
            const int64_t *table = tables + s * table_stride;
            const float *qs = q + s * q_stride_s;
            float *out = scores + s * H * lmax;
            for (int64_t t = first; t < end; t++) {
                const float *r = row_at(k, table, t, shift, bs, row);
                if (t + AHEAD < end) prefetch(row_at(k, table, t + AHEAD, shift, bs, row), span);
                for (int64_t h = 0; h < H; h++) {
                    const float *key = r + (h / G) * W, *qh = qs + h * q_stride_h;
                    float acc = 0.f;
#pragma omp simd reduction(+ : acc)
                    for (int64_t d = 0; d < D; d++) acc += qh[d] * key[d];
                    out[h * lmax + t] = acc;
                }
            }
            if (c == splits - 1)
                for (int64_t h = 0; h < H; h++)
                    for (int64_t t = len; t < lmax; t++) out[h * lmax + t] = -INFINITY;
        }
    }
}

void decode_values(const struct decode_args *a) {
    const float *probs = a->probs, *v = a->values;
    const int64_t *tables = a->tables, *lens = a->lens;
    const int64_t table_stride = a->table_width;
    const int64_t S = a->num_seqs, H = a->num_heads, Hkv = a->num_kv_heads, D = a->head_dim, W = a->width;
    const int64_t bs = a->block_size, lmax = a->max_len, splits = a->splits;
    float *partial = a->partial, *out = a->out;
    const int threads = (int)a->threads;
    const int64_t G = H / Hkv, row = Hkv * W, span = ((Hkv - 1) * W + D) * (int64_t)sizeof(float);
    const int shift = __builtin_ctzll(bs);
#pragma omp parallel num_threads(threads)
    {
#pragma omp for collapse(2) schedule(dynamic, 1)
        for (int64_t s = 0; s < S; s++) {
            for (int64_t c = 0; c < splits; c++) {
                int64_t first, end;
                run_of(lens[s], splits, c, &first, &end);
                const int64_t *table = tables + s * table_stride;
                const float *ps = probs + s * H * lmax;
                float *os = splits == 1 ? out + s * H * D : partial + (s * splits + c) * H * D;
                for (int64_t i = 0; i < H * D; i++) os[i] = 0.f;
                for (int64_t t = first; t < end; t++) {
                    const float *r = row_at(v, table, t, shift, bs, row);
                    if (t + AHEAD < end) prefetch(row_at(v, table, t + AHEAD, shift, bs, row), span);
                    for (int64_t h = 0; h < H; h++) {
                        const float p = ps[h * lmax + t], *value = r + (h / G) * W;
                        float *oh = os + h * D;
#pragma omp simd
                        for (int64_t d = 0; d < D; d++) oh[d] += p * value[d];
                    }
                }
            }
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
