// Per-row top-k of float32 logits: exact radix select (DESIGN.md section 6).
//
// Order: uint32 keys whose unsigned order is the float order, NaN lowest,
// -0 == +0 (the reference's order_keys). A row [start, end) of length n:
//   n <= k : 0 .. n-1 then -1, no logits read;
//   n >  k : exactly k distinct in-window positions (relative to start) holding
//            the k largest keys, in no particular order, any choice among exact
//            ties at the threshold.
//
// Algorithm (one row per CTA, or per cluster of C CTAs that split the row):
//   R0  histogram of a coarse 11-bit key over every value of the row, one pass:
//       the top 11 bits of the fp16 order key of fma(x, scale, bias), monotone
//       in the float order, 32 bins per octave around -bias / scale. scale and
//       bias adapt to the row (tk_adapt: a robust centre and spread of its first
//       values), so shifted, scaled or low-contrast rows spread over the bins as
//       standard normal ones do (with the raw fp16 key they crowd a few bins:
//       contended atomics, and candidates too many for shared memory);
//       the threshold bin B0 is where the count from the top reaches k.
//       Filter pass: coarse > B0 -> emitted through an atomic cursor;
//       coarse == B0 -> candidates. A compare a value marks the few at or above
//       B0 (on long slices against B0's float bounds, tk_coarse_floor2), and a
//       loop over the marks acts on them, so that the action's code is not
//       unrolled into every value's slot (tk_marks).
//   Finish: when the candidates number at most TK_RANK_MAX (the usual case:
//       tens to a few hundred), they are gathered into one shared list as packed
//       (key << 32 | ~position), each CTA of a cluster writing its range of it
//       locally and then copying the other ranges through distributed shared
//       memory, and each one's rank among them is found; rank < still-needed ->
//       output slot emitted + rank. Exact, ties to the lower position. At most
//       TK_RANK_SCAN_MAX of them, or in clusters of 4 CTAs or more, a warp counts
//       each candidate's rank over the whole list; more (a row of the scoring
//       kernel's logits reaches 400) are counting-sorted into buckets first, so
//       that each is compared only with its own bucket (tk_bucket_rank).
//   Fallback (many candidates: heavy ties, narrow data): radix rounds on the
//       full 32-bit key, 11 bits a round from the highest bit in which the
//       candidates' keys differ (their range is found after the filter pass,
//       over the cluster) down to bit 0: histogram,
//       threshold digit, emit the candidates above it, keep those equal; as
//       soon as the kept ones are few, finish as above. The round where the
//       candidates equal to the threshold are all needed, or the last round
//       (identical keys), takes exactly the remaining count through a second
//       cursor. A CTA whose candidates do not fit its buffer (CAND) keeps
//       none and rescans its global slice with the candidate predicate
//       (coarse == B0 and the key prefix decided so far): exact, never drops.
//
// Rows of at most topk.ROW_WIDTH values: the same algorithm in tk_srow_body, one CTA a
// row holding the row in shared memory ("Rows in shared memory" below).
//
// Cluster split (C > 1, __cluster_dims__; C = 16 is a non-portable size, which the
// launcher allows on the function): each CTA owns a contiguous slice;
// a round's local histogram becomes suffix sums in place, and after a cluster
// barrier one warp a CTA sums the C suffix arrays through distributed shared
// memory at 32 coarse points then 64 bins (the totals are the suffix sums of
// the cluster histogram), finds the threshold and each rank's counts above
// and at it, and places the CTA's emissions from them: no global atomics, no
// second launch. Histograms are double-buffered: one barrier a round.
//
// Everything stays on the launching stream; no host synchronisation.

#define TK_BINS 2048
#define TK_RANK_MAX 512
#define TK_RANK_SCAN_MAX 32
#define TK_MAX_CLUSTER 16

struct TkSmem {
    u32 hist[2][TK_BINS];   // first, in a struct 8-byte aligned (pages): tk_find_cluster
                            // reads even-indexed bin pairs as one 8-byte load
    u32 wtot[32];
    float wmean[32];   // tk_adapt's statistics of the row's first values, a warp each
    float wmax[32];
    float scale;       // the coarse key's transform (tk_coarse), chosen by warp 0
    float bias;
    u32 kmin, kmax;    // key range of R0's candidates (the fallback's first digit)
    u32 ckmin, ckmax;  // the same over the cluster
    u32 cursor;
    u32 tie_cursor;
    u32 ncand;
    // Round state, uniform over the CTA (kept here to spare registers).
    u32 T;             // threshold digit of the round
    u32 eq_tot;        // cluster count at T
    u32 eq_before;     // count at T in lower ranks (gather offset)
    u32 eq_start[TK_MAX_CLUSTER + 1];   // rank r's candidates: [eq_start[r], eq_start[r+1])
    u32 eq_local;      // this CTA's count at T
    u32 need;          // how many still to choose after the round's "above"
    u32 emitted;       // how many the cluster has placed, "above" of the round included
    u32 above_base;    // where this CTA's "above" emissions of the round start
    u32 tie_base;      // where its share of the threshold ties starts
    u32 take;          // its share of the ties (final round)
    u32 fin;           // this round decides the rest through the tie cursor
    // Fused slot mapping (decode rows with a block table; pages == nullptr: write
    // positions): the request's row of page ids, its length, log2 of the page size.
    const int* pages;
    int cols, shift;
    // hist[b][64 l] for l < 32, contiguous: tk_find_cluster's first round reads these
    // across the ranks; read in place, at a 64-word stride, all 32 lanes hit one bank of
    // every rank's shared memory (32-way conflicts, C times).
    u32 coarse[2][32];
};
static_assert(alignof(TkSmem) >= 8, "tk_find_cluster's 8-byte bin-pair loads need hist "
                                    "8-byte aligned");

// What a row writes for its in-window position pos: pos itself, or the global cache
// slot of it, as cps_local_to_global_slots computes it (-1 for a position past the
// table, a negative page id or a slot past int32). Read from shared memory at each
// write so that the selection's registers stay as they are.
template <class S>
__device__ __forceinline__ int tk_out(const S& s, int pos) {
    const int* pages = s.pages;
    if (pages == nullptr) return pos;
    const int col = pos >> s.shift;
    if (col >= s.cols) return -1;
    const long long page = pages[col];
    const long long slot = (page << s.shift) + (pos & ((1 << s.shift) - 1));
    return page >= 0 && slot <= 0x7FFFFFFFll ? (int)slot : -1;
}

// Full order key: NaN -> 0 (lowest), -0 -> +0, else the usual sign flip.
__device__ __forceinline__ u32 tk_key(float x) {
    u32 u = __float_as_uint(x);
    const u32 a = u & 0x7FFFFFFFu;
    if (a > 0x7F800000u) return 0u;
    if (a == 0u) u = 0u;
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Coarse 11-bit key: top bits of the fp16 order key of y = fma(x, scale, bias),
// bias = -off * scale (one rounding of x * scale + bias, scale > 0: monotone in x,
// and then round to nearest fp16 is monotone, so coarse(a) <= coarse(b) whenever
// key(a) <= key(b); bias is never -0, so x = -0 and +0 both give +bias).
// NaN -> 0, which no number reaches (-inf gives 31).
__device__ __forceinline__ u32 tk_coarse(float x, float scale, float bias) {
    const u32 a = __float_as_uint(x) & 0x7FFFFFFFu;
    if (a > 0x7F800000u) return 0u;
    const float y = fmaf(x, scale, bias);
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(y));
    const u32 hk = (h & 0x8000u) ? (~(u32)h & 0xFFFFu) : ((u32)h | 0x8000u);
    return hk >> 5;
}

__device__ __forceinline__ float tk_key_float(u32 key) {        // tk_key's inverse
    return __uint_as_float((key & 0x80000000u) ? (key & 0x7FFFFFFFu) : ~key);
}

// The float thresholds of coarse bins b (lanes 0-15) and b + 1 (lanes 16-31): for every
// non-NaN x, tk_coarse(x) >= bin exactly when x >= the returned value (tk_coarse is
// monotone in the float order); -inf for bin 0; NaN when no float reaches the bin (then
// x >= it is false for every x, as for NaN x itself, whose coarse key 0 is below any
// bin >= 1). Warp-collective, so that a filter pass compares floats instead of computing
// every value's coarse key. Each half of the warp searches the order keys 16 ways a
// round, from a bracket of +-2**16 keys around the bin's estimated start ((its first
// fp16 value - bias) / scale), checked by the coarse keys at its ends (the whole range
// -inf .. +inf when the check fails): five rounds (eight without a bracket) where two
// full 32-way searches took seven each, in a row (the srow body's CTA waits for them at
// a barrier).
__device__ __forceinline__ float tk_coarse_floor2(u32 b, float scale, float bias, int lane) {
    const u32 first = 0x007FFFFFu, sentinel = 0xFF800001u;   // -inf, past +inf
    const u32 span = 1u << 16;
    const int half = lane >> 4, hl = lane & 15;
    const u32 bb = b + (u32)half;                  // this half's bin
    u32 lo = first, hi = sentinel;                 // the smallest key reaching bb is in [lo, hi]
    if (bb >= TK_BINS) {
        lo = hi = sentinel;                        // no float reaches it
    } else {
        const u32 hk = bb << 5;                    // the bin's first fp16 order key
        const u32 hb = (hk & 0x8000u) ? (hk & 0x7FFFu) : (~hk & 0xFFFFu);   // its fp16 bits
        const unsigned short h = (unsigned short)hb;
        float f;
        asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
        const float xe = (f - bias) / scale;
        if (isfinite(xe)) {
            const u32 ke = tk_key(xe);
            const u32 blo = ke > first + span ? ke - span : first;
            const u32 bhi = ke < sentinel - span ? ke + span : sentinel;
            const bool ok_lo = blo == first || tk_coarse(tk_key_float(blo - 1u), scale, bias) < bb;
            const bool ok_hi = bhi == sentinel || tk_coarse(tk_key_float(bhi), scale, bias) >= bb;
            if (ok_lo && ok_hi) {
                lo = blo;
                hi = bhi;
            }
        }
    }
    while (__ballot_sync(0xffffffffu, lo < hi) != 0u) {
        const u32 step = (hi - lo + 15u) / 16u;
        const u32 kl = lo + (u32)hl * step;
        const bool yes = kl >= hi || tk_coarse(tk_key_float(kl), scale, bias) >= bb;
        const u32 m = (__ballot_sync(0xffffffffu, yes) >> (16 * half)) & 0xFFFFu;
        if (lo < hi) {
            if (m == 0u) {
                lo = lo + 15u * step + 1u;
            } else {
                const int j = __ffs(m) - 1;
                const u32 kj = lo + (u32)j * step;
                if (j == 0) {
                    hi = lo;
                } else {
                    lo = lo + (u32)(j - 1) * step + 1u;
                    hi = min(kj, hi);
                }
            }
        }
    }
    return lo >= sentinel ? __uint_as_float(0x7fc00000u) : tk_key_float(lo);
}

// The coarse key's transform from per-warp statistics of the row's first values
// (lane l < nw holds warp l's mean and max of its finite values, has: any):
// off = the median of the warps' means, scale = the power of two that brings the
// median of their (max - mean) into [2, 4): the top of the row then spans the
// fp16 octaves a standard normal row does. Medians, so that a few outliers
// cannot stretch the scale; (0, 1) when no warp saw a finite value. Returns scale
// and bias = -off * scale (+0, never -0, when off is 0), the same in every lane of
// a warp and in every warp given the same statistics.
__device__ __forceinline__ void tk_adapt(float mean, float mx, bool has, int lane, int nw,
                                         float& scale, float& bias) {
    const u32 full = 0xffffffffu;
    const u32 valid = __ballot_sync(full, has && lane < nw);
    const int m = __popc(valid);
    const float spread = mx - mean;
    // Lower median of each statistic over the valid lanes: rank by (value, lane).
    int rm = 0, rs = 0;
    for (int j = 0; j < nw; ++j) {
        const float mj = __shfl_sync(full, mean, j), sj = __shfl_sync(full, spread, j);
        if ((valid >> j) & 1u) {
            rm += (mj < mean || (mj == mean && j < lane)) ? 1 : 0;
            rs += (sj < spread || (sj == spread && j < lane)) ? 1 : 0;
        }
    }
    const bool mine = has && lane < nw;
    const u32 at_m = __ballot_sync(full, mine && rm == (m - 1) / 2);
    const u32 at_s = __ballot_sync(full, mine && rs == (m - 1) / 2);
    scale = 1.0f;
    bias = 0.0f;
    if (m == 0) return;
    const float c = __shfl_sync(full, mean, __ffs(at_m) - 1);
    const float d = __shfl_sync(full, spread, __ffs(at_s) - 1);
    if (!(d > 0.0f) || !isfinite(d) || !isfinite(c)) return;   // one value: any scale
    int e;
    frexpf(d, &e);                                  // d < 2^e <= 2 d
    scale = ldexpf(1.0f, min(127, max(-126, 2 - e)));
    bias = -c * scale;
    if (bias == 0.0f || !isfinite(bias)) bias = 0.0f;         // +0; c * scale overflowed: 0
}

// The window [st, en) of a row, clamped to [0, width]: mode 0 row_starts / row_ends;
// mode 1 decode rows, start 0, row (b, j) ends at L_b - next_n + j + 1 with
// context_lens [B]; mode 2 context_lens [B, next_n] gives each row's end.
__device__ __forceinline__ void tk_row_window(int row, long long width,
                                              const int* __restrict__ row_starts,
                                              const int* __restrict__ row_ends,
                                              const int* __restrict__ ctx, int next_n, int mode,
                                              long long& st, long long& en) {
    if (mode != 0) {
        st = 0;
        if (mode == 2) {
            en = ctx[row];
        } else {
            const int b = row / next_n;
            const int j = row - b * next_n;
            en = (long long)ctx[b] - next_n + j + 1;
        }
    } else {
        st = row_starts[row];
        en = row_ends[row];
    }
    en = min(max(en, 0ll), width);
    st = min(max(st, 0ll), en);
}

// tk_adapt's statistics of one warp: the mean and max of the finite values among
// the four of v4 (row positions i0 .. i0 + 3, when has_unit) that lie in [0, n),
// summed over the warp; lane 0 stores them (a NaN max marks a warp without finite
// values).
__device__ __forceinline__ void tk_warp_stats(float4 v4, bool has_unit, int i0, int n, int lane,
                                              float& wmean, float& wmax) {
    const float xs[4] = {v4.x, v4.y, v4.z, v4.w};
    float sum = 0.f, mx = __int_as_float(0xff800000);
    int cnt = 0;
#pragma unroll
    for (int c = 0; c < 4; ++c) {
        const int i = i0 + c;
        if (has_unit && i >= 0 && i < n && isfinite(xs[c])) {
            sum += xs[c];
            mx = fmaxf(mx, xs[c]);
            ++cnt;
        }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        sum += __shfl_xor_sync(0xffffffffu, sum, o);
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
        cnt += __shfl_xor_sync(0xffffffffu, cnt, o);
    }
    if (lane == 0) {
        const float mean = cnt > 0 ? sum / (float)cnt : 0.f;
        const bool ok = cnt > 0 && isfinite(mean);
        wmean = ok ? mean : 0.f;
        wmax = ok ? mx : __int_as_float(0x7fc00000);
    }
}

// tk_adapt over the nw warps' statistics in shared memory (every lane of the calling
// warp gets the transform; warp 0 calls it, then a barrier shares it).
__device__ __forceinline__ void tk_adapt_warps(const float* wmean, const float* wmax, int lane,
                                               int nw, float& scale, float& bias) {
    const float wm = lane < nw ? wmean[lane] : 0.f;
    const float wx = lane < nw ? wmax[lane] : __int_as_float(0x7fc00000);
    tk_adapt(wm, wx, wx == wx, lane, nw, scale, bias);
}

// A bit mask of a thread's slots: bit 4 j + c for value c of u[j], the float4 unit
// v0 + j * stride (of the row's units, whose first holds `head` values before the row),
// set when that value is in the row's [0, n) and pred(x) holds. The passes that act on
// few values mark them here (a compare each, unrolled) and then loop over the marks, so
// that the action's code is there once (inlined into every unrolled slot, it streamed
// through the instruction cache: the filter pass ran ~4x slower).
// Interior: the caller knows every slot is in the row (no bounds tests).
template <bool INTERIOR, int NV, class Pred>
__device__ __forceinline__ u32 tk_marks_at(const float4 (&u)[NV], int v0, int stride, int v_hi,
                                           int head, int n, Pred pred) {
    static_assert(NV * 4 <= 32, "one mask bit a slot");
    u32 marks = 0u;
#pragma unroll
    for (int j = 0; j < NV; ++j) {
        const int v = v0 + j * stride;
        const int i0 = v * 4 - head;
        const float xs[4] = {u[j].x, u[j].y, u[j].z, u[j].w};
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            const bool in = (INTERIOR || (v < v_hi && i0 + c >= 0 && i0 + c < n)) && pred(xs[c]);
            marks |= (in ? 1u : 0u) << (4 * j + c);
        }
    }
    return marks;
}
// The units v0 .. v0 + (NV - 1) stride of every thread of the CTA (v0 = base + tid)
// cover [base, base + NV stride): interior when that is inside the row's [0, n).
template <int NV, class Pred>
__device__ __forceinline__ u32 tk_marks(const float4 (&u)[NV], int v0, int stride, int v_hi,
                                        int head, int n, int base, Pred pred) {
    const int end = base + NV * stride;                  // one past the block's last unit
    if (end <= v_hi && base * 4 - head >= 0 && end * 4 - head <= n)
        return tk_marks_at<true>(u, v0, stride, v_hi, head, n, pred);
    return tk_marks_at<false>(u, v0, stride, v_hi, head, n, pred);
}

__device__ __forceinline__ u64 tk_pack(u32 key, int i) {
    return ((u64)key << 32) | (u64)(~(u32)i);
}

__device__ __forceinline__ u32 tk_cluster_rank() {
    u32 r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}

template <int C>
__device__ __forceinline__ void tk_cluster_sync() {
    if (C > 1) {
        asm volatile("barrier.cluster.arrive.release.aligned;\n\t"
                     "barrier.cluster.wait.acquire.aligned;" ::: "memory");
    } else {
        __syncthreads();
    }
}

// Load a u32 of CTA `rank`'s shared memory at the address of local `p`.
template <int C>
__device__ __forceinline__ u32 tk_load_rank(const u32* p, u32 rank) {
    if (C == 1) return *p;
    const u32 local = (u32)__cvta_generic_to_shared(p);
    u32 remote, v;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(rank));
    asm volatile("ld.shared::cluster.u32 %0, [%1];" : "=r"(v) : "r"(remote));
    return v;
}

template <int C>
__device__ __forceinline__ u64 tk_load_rank64(const u64* p, u32 rank) {
    if (C == 1) return *p;
    const u32 local = (u32)__cvta_generic_to_shared(p);
    u32 remote;
    u64 v;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(rank));
    asm volatile("ld.shared::cluster.u64 %0, [%1];" : "=l"(v) : "r"(remote));
    return v;
}

template <int C>
__device__ __forceinline__ u32 tk_sum_ranks(const u32* p) {
    u32 v[C];
#pragma unroll
    for (int r = 0; r < C; ++r) v[r] = tk_load_rank<C>(p, (u32)r);
    u32 s = 0;
#pragma unroll
    for (int r = 0; r < C; ++r) s += v[r];
    return s;
}

// The rank finish (tk_rank_finish) of more than TK_RANK_SCAN_MAX candidates. Counting
// each one's rank over the whole list costs m^2 / 32 warp steps, each waiting on a
// shared-memory load: 9 us at m = 409 in one CTA, which a decode row of the scoring
// kernel's logits reaches (their threshold bin is crowded where normal rows' is not).
// Instead the m packed candidates list[0, m) (distinct) are counting-sorted into THREADS
// buckets by their key's place in [kmin, kmax], highest keys first, into bucket[0, m):
// a candidate's rank is the count in the buckets before its own plus its rank inside
// its bucket (one or two on these lists; all of them when every key is equal). Every
// thread takes part; the candidates c = first, first + step, ... whose rank is below
// need go to orow[base + rank] (out(position)). cnt and at: THREADS words each; red:
// 2 * THREADS / 32 words; wtot: 32 words. Five barriers.
template <int THREADS, class Out>
__device__ __forceinline__ void tk_bucket_rank(const u64* list, u32 m, u64* bucket, u32* cnt,
                                               u32* at, u32* red, u32* wtot, u32 need,
                                               u32 base, int k, int* __restrict__ orow,
                                               u32 first, u32 step, int tid, Out out) {
    constexpr int NW = THREADS / 32;
    constexpr int LOG_BUCKETS = THREADS == 512 ? 9 : THREADS == 256 ? 8 : -1;
    static_assert(LOG_BUCKETS > 0, "a bucket a thread: 256 or 512 threads");
    const u32 full = 0xffffffffu;
    const int lane = tid & 31, warp = tid >> 5;
    u32 lo = 0xFFFFFFFFu, hi = 0u;
    for (u32 c = (u32)tid; c < m; c += THREADS) {
        const u32 key = (u32)(list[c] >> 32);
        lo = min(lo, key);
        hi = max(hi, key);
    }
    lo = __reduce_min_sync(full, lo);
    hi = __reduce_max_sync(full, hi);
    if (lane == 0) {
        red[warp] = lo;
        red[NW + warp] = hi;
    }
    cnt[tid] = 0u;
    __syncthreads();
    u32 kmin = red[0], kmax = red[NW];
#pragma unroll
    for (int w = 1; w < NW; ++w) {
        kmin = min(kmin, red[w]);
        kmax = max(kmax, red[NW + w]);
    }
    // (key - kmin) >> shift < THREADS; bucket 0 holds the highest keys
    const u32 span = kmax - kmin;
    const int shift = max(0, (span ? 32 - __clz(span) : 0) - LOG_BUCKETS);
    auto bucket_of = [&](u64 v) -> u32 {
        return (u32)(THREADS - 1) - ((((u32)(v >> 32)) - kmin) >> shift);
    };
    for (u32 c = (u32)tid; c < m; c += THREADS) atomicAdd(&cnt[bucket_of(list[c])], 1u);
    __syncthreads();
    const u32 x = cnt[tid];                        // exclusive scan: bucket tid's start
    u32 incl = x;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const u32 y = __shfl_up_sync(full, incl, o);
        if (lane >= o) incl += y;
    }
    if (lane == 31) wtot[warp] = incl;
    __syncthreads();
    u32 before = 0u;
    for (int w = 0; w < warp; ++w) before += wtot[w];
    at[tid] = before + incl - x;
    __syncthreads();
    for (u32 c = (u32)tid; c < m; c += THREADS) {
        const u64 v = list[c];
        bucket[atomicAdd(&at[bucket_of(v)], 1u)] = v;
    }
    __syncthreads();                               // at[b]: the end of bucket b
    for (u32 c = first; c < m; c += step) {
        const u64 me = list[c];
        const u32 b = bucket_of(me);
        const u32 end = at[b], start = end - cnt[b];
        if (start >= need) continue;
        u32 r = start;
        for (u32 j = start; j < end; ++j) r += bucket[j] > me ? 1u : 0u;
        if (r < need) {
            const u32 p = base + r;
            if (p < (u32)k) orow[p] = out((int)~(u32)me);
        }
    }
}

// Select modes: a round that may finish with the tie cursor only when all the
// candidates at its threshold are needed; the last round (always finishes).
#define TK_ROUND 0
#define TK_LAST 1

// One thread records a round's outcome: threshold T, the cluster counts
// above it and at it, this CTA's counts before it (ab, eb) and at it.
template <class S>
__device__ __forceinline__ void tk_decide(S& s, u32 T, u32 above_tot, u32 eq_tot,
                                          u32 ab, u32 eb, u32 eq_local, int mode) {
    s.T = T;
    const bool last = mode == TK_LAST;
    const u32 emitted = s.emitted;
    const u32 nn = s.need - above_tot;
    s.eq_tot = eq_tot;
    s.eq_before = eb;
    s.eq_local = eq_local;
    s.fin = (last || nn == eq_tot) ? 1u : 0u;
    s.above_base = emitted + ab;
    s.tie_base = emitted + above_tot + min(eb, nn);
    s.take = nn > eb ? min(nn - eb, eq_local) : 0u;
    s.need = nn;
    s.emitted = emitted + above_tot;
}

// A one-CTA round's suffix sums over a complete histogram h: loc[j] counts the values
// in the thread's bins tid * BPT + j and above, up to its last bin; returns the count
// in every higher bin (the other threads'). wtot: NW words of scratch; one barrier.
template <int THREADS>
__device__ __forceinline__ u32 tk_suffix(const u32* h, u32* wtot, u32 (&loc)[TK_BINS / THREADS],
                                         int tid, int lane, int warp) {
    constexpr int BPT = TK_BINS / THREADS;
    u32 sum = 0;
#pragma unroll
    for (int j = BPT - 1; j >= 0; --j) {
        sum += h[tid * BPT + j];
        loc[j] = sum;
    }
    u32 x = sum;                                      // suffix over lanes
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const u32 y = __shfl_down_sync(0xffffffffu, x, o);
        if (lane + o < 32) x += y;
    }
    if (lane == 0) wtot[warp] = x;
    __syncthreads();
    u32 hi = 0;
    for (int w = warp + 1; w < THREADS / 32; ++w) hi += wtot[w];
    return x - sum + hi;
}

// A round's start once its histogram h is being completed: the emission counters reset,
// a barrier (h complete), then tk_suffix.
template <int THREADS, class S>
__device__ __forceinline__ u32 tk_round_suffix(S& s, const u32* h, u32 (&loc)[TK_BINS / THREADS],
                                               int tid, int lane, int warp) {
    if (tid == 0) {
        s.cursor = 0u;
        s.tie_cursor = 0u;
        s.ncand = 0u;
    }
    __syncthreads();                                  // histogram complete
    return tk_suffix<THREADS>(h, s.wtot, loc, tid, lane, warp);
}

// The thread whose bins hold the one where the count from the top reaches need
// records the round (a one-CTA row: no other ranks); returns whether it was this one.
template <class S, int BPT>
__device__ __forceinline__ bool tk_decide_local(S& s, const u32 (&loc)[BPT], u32 excl, u32 need,
                                                int tid, int mode) {
    bool decided = false;
#pragma unroll
    for (int j = 0; j < BPT; ++j) {
        const u32 tj = loc[j] + excl;
        const u32 tn = j + 1 < BPT ? loc[j + 1] + excl : excl;
        if (tj >= need && tn < need) {
            tk_decide(s, (u32)(tid * BPT + j), tn, tj - tn, 0u, 0u, tj - tn, mode);
            decided = true;
        }
    }
    return decided;
}

// Warp 0 of each CTA of a cluster: threshold of the summed suffix arrays h
// (this round's buffer in every rank), in two steps of 32 then 64 bins; coarse: the
// same buffer's h[64 l], l < 32, stored contiguously (s.coarse, by select).
template <int C>
__device__ __forceinline__ void tk_find_cluster(TkSmem& s, const u32* h, const u32* coarse,
                                                u32 need, int rank, int lane, int mode) {
    const u32 full = 0xffffffffu;
    const u32 t1 = tk_sum_ranks<C>(coarse + lane);          // count in bins >= 64 lane
    const u32 m1 = __ballot_sync(full, t1 >= need);         // a prefix of lanes
    if (m1 == 0u) return;             // fewer counted than need: never (see the callers)
    const int S = 31 - __clz(m1);
    const u32 b0 = 64u * S + 2u * lane;
    u32 ta = 0u, tb = 0u;                                   // bins b0 and b0 + 1: one
    {                                                       // 8-byte load a rank
        u64 v[C];
#pragma unroll
        for (int r = 0; r < C; ++r)
            v[r] = tk_load_rank64<C>(reinterpret_cast<const u64*>(h + b0), (u32)r);
#pragma unroll
        for (int r = 0; r < C; ++r) {
            ta += (u32)v[r];
            tb += (u32)(v[r] >> 32);
        }
    }
    const u32 ma = __ballot_sync(full, ta >= need), mb = __ballot_sync(full, tb >= need);
    const int la = 31 - __clz(ma);
    const bool odd = (mb >> la) & 1u;
    const u32 ta_la = __shfl_sync(full, ta, la), tb_la = __shfl_sync(full, tb, la);
    const u32 ta_next = __shfl_sync(full, ta, (la + 1) & 31);
    const u32 t1_next = __shfl_sync(full, t1, (S + 1) & 31);
    u32 T, tot_t, tot_n;
    if (!odd) {
        T = 64u * S + 2u * la;
        tot_t = ta_la;
        tot_n = tb_la;
    } else {
        T = 64u * S + 2u * la + 1u;
        tot_t = tb_la;
        tot_n = la < 31 ? ta_next : (S < 31 ? t1_next : 0u);
    }
    u32 a = 0u, e = 0u;
    if (lane < C) {
        a = T + 1 < TK_BINS ? tk_load_rank<C>(h + T + 1, (u32)lane) : 0u;
        e = tk_load_rank<C>(h + T, (u32)lane) - a;
    }
    const u32 ab = __reduce_add_sync(full, lane < rank ? a : 0u);
    const u32 eb = __reduce_add_sync(full, lane < rank ? e : 0u);
    const u32 el = __shfl_sync(full, e, rank);
    u32 ex = e;                                             // inclusive scan over ranks
#pragma unroll
    for (int o = 1; o < C; o <<= 1) {
        const u32 y = __shfl_up_sync(full, ex, o);
        if (lane >= o) ex += y;
    }
    if (lane < C) s.eq_start[lane + 1] = ex;
    if (lane == 0) s.eq_start[0] = 0u;
    if (lane == 0) tk_decide(s, T, tot_n, tot_t - tot_n, ab, eb, el, mode);
}

// Every kernel's parameters (and the bodies', which the entry points forward them to).
#define TK_PARAMS                                                                           \
    const float* __restrict__ logits, long long width, const int* __restrict__ row_starts,  \
        const int* __restrict__ row_ends, const int* __restrict__ context_lens, int next_n, \
        int mode, int k, int* __restrict__ out, const int* __restrict__ block_table,        \
        int bt_cols, int bs_shift

#define TK_ARGS logits, width, row_starts, row_ends, context_lens, next_n, mode, k, out,     \
                block_table, bt_cols, bs_shift

template <int THREADS, int VEC, int C, int CAND>
__device__ __forceinline__ void tk_body(TK_PARAMS) {
    constexpr int NW = THREADS / 32;
    constexpr int BPT = TK_BINS / THREADS;      // histogram bins owned by a thread
    constexpr int TILE = THREADS * VEC;         // float4 units a tile
    static_assert(TK_BINS % THREADS == 0, "bins per thread");
    static_assert(C >= 1 && C <= TK_MAX_CLUSTER, "cluster size");
    __shared__ TkSmem s;
    // Two candidate buffers of CAND packed (key << 32) | ~position (larger ranks first),
    // in dynamic shared memory: 2 * CAND * 8 bytes a launch (topk.py). The cluster
    // variants, one CTA an SM, take 8192 each, so that crowded bins (a low-contrast
    // row's ~1000-2000 a CTA) stay in shared memory instead of rescanning the slice.
    extern __shared__ __align__(16) u64 tk_cand[];
    auto cand = [&](int b) { return tk_cand + b * CAND; };

    const int tid = threadIdx.x;
    const int lane = tid & 31, warp = tid >> 5;
    const int row = (int)(blockIdx.x / C);
    const int rank = C > 1 ? (int)tk_cluster_rank() : 0;

    // Decode rows start at position 0: the units tk_adapt's statistics read are known
    // before the window is, so their load goes out beside the context length's instead
    // of after it (its latency was the first thing every long row waited on twice).
    const float* lrow = logits + (long long)row * width;
    float4 stat4 = make_float4(0.f, 0.f, 0.f, 0.f);
    if (mode != 0) {
        const int head0 = (int)((reinterpret_cast<size_t>(lrow) >> 2) & 3);
        if ((long long)tid < (head0 + width + 3) >> 2)          // a unit of the row's width
            stat4 = __ldg(reinterpret_cast<const float4*>(lrow - head0) + tid);
    }

    long long st, en;
    tk_row_window(row, width, row_starts, row_ends, context_lens, next_n, mode, st, en);
    int* __restrict__ orow = out + (long long)row * k;
    if (tid == 0) {
        s.pages = block_table != nullptr && mode != 0
                      ? block_table + (long long)(row / next_n) * bt_cols : nullptr;
        s.cols = bt_cols;
        s.shift = bs_shift;
    }
    __syncthreads();
    if (en - st <= (long long)k) {                // short row: 0..n-1, then -1
        const int n = (int)(en - st);
        for (int j = rank * THREADS + tid; j < k; j += C * THREADS)
            orow[j] = j < n ? tk_out(s, j) : -1;
        return;                                   // uniform over the cluster
    }
    const int n = (int)(en - st);

    // The row as 16-byte units from the aligned address at or below its start
    // (st <= width < 2**31: a 32-bit offset from the row; a 64-bit one spills in c1_t256).
    const float* q = lrow + (int)st;
    const int head = (int)((reinterpret_cast<size_t>(q) >> 2) & 3);
    const float4* qa = reinterpret_cast<const float4*>(q - head);
    const int nv = (head + n + 3) >> 2;
    const int per = (nv + C - 1) / C;
    const int v_lo = min(nv, rank * per);
    const int v_hi = min(nv, v_lo + per);
    const int ntiles = (v_hi - v_lo + TILE - 1) / TILE;

    float4 vals[VEC];
    auto load = [&](int t) {
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
            const int v = v_lo + t * TILE + j * THREADS + tid;
            vals[j] = v < v_hi ? __ldg(qa + v) : make_float4(0.f, 0.f, 0.f, 0.f);
        }
    };
    if (ntiles > 0) load(0);          // in flight while the transform is chosen

    // The coarse key's transform from the row's first THREADS float4 units (read
    // alike by every CTA of a cluster, so all bin alike): each warp's mean and max.
    // Rank 0's first tile holds them when its slice is that long.
    {
        float4 v4 = make_float4(0.f, 0.f, 0.f, 0.f);
        if (mode != 0) {
            v4 = stat4;                 // the same units (st is 0), loaded above
        } else if (rank == 0 && v_hi >= min(nv, THREADS)) {
            v4 = vals[0];
        } else if (tid < nv) {
            v4 = __ldg(qa + tid);
        }
        tk_warp_stats(v4, tid < nv, tid * 4 - head, n, lane, s.wmean[warp], s.wmax[warp]);
    }
    for (int b = tid; b < TK_BINS; b += THREADS) s.hist[0][b] = 0u;   // R0's buffer
    if (tid == 0) {
        s.need = (u32)k;
        s.emitted = 0u;
        s.kmin = 0xFFFFFFFFu;
        s.kmax = 0u;
    }
    __syncthreads();
    // Warp 0 chooses the transform, then a barrier shares it, as r256 does. (Every warp
    // computing it alike spared the barrier; the phase, 1.1 us, is one warp's latency
    // either way: tk_adapt's median ranks.)
    if (warp == 0) {
        float sc, bi;
        tk_adapt_warps(s.wmean, s.wmax, lane, NW, sc, bi);
        if (lane == 0) {
            s.scale = sc;
            s.bias = bi;
        }
    }
    __syncthreads();
    // In registers for R0 and its filter pass (a shared-memory operand would be
    // re-read after every atomic); the rare fallback re-reads them, since holding
    // them through it spills (64 registers a thread).
    const float cscale = s.scale, cbias = s.bias;

    auto each = [&](int t, auto&& f) {
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
            const int v = v_lo + t * TILE + j * THREADS + tid;
            if (v < v_hi) {
                const int i0 = v * 4 - head;
                const float xs[4] = {vals[j].x, vals[j].y, vals[j].z, vals[j].w};
#pragma unroll
                for (int c = 0; c < 4; ++c) {
                    const int i = i0 + c;
                    if (i >= 0 && i < n) f(i, xs[c]);
                }
            }
        }
    };

    // Threshold of a round from histogram buffer hb (suffix sums, cluster
    // totals, tk_decide); ends with a barrier.
    auto select = [&](int hb, u32 need, int mode) {
        u32* h = s.hist[hb];
        u32 loc[BPT];
        const u32 excl = tk_round_suffix<THREADS>(s, h, loc, tid, lane, warp);
        if (C == 1) {
            tk_decide_local(s, loc, excl, need, tid, mode);
        } else {
#pragma unroll
            for (int j = 0; j < BPT; ++j) h[tid * BPT + j] = loc[j] + excl;
            static_assert(64 % BPT == 0, "one thread holds bin 64 l");
            if ((tid * BPT) % 64 == 0) s.coarse[hb][tid * BPT / 64] = loc[0] + excl;
            tk_cluster_sync<C>();
            if (warp == 0) tk_find_cluster<C>(s, h, s.coarse[hb], need, rank, lane, mode);
        }
        __syncthreads();
    };

    auto emit_above = [&](int i) {
        const u32 p = s.above_base + atomicAdd(&s.cursor, 1u);
        if (p < (u32)k) orow[p] = tk_out(s, i);
    };
    auto emit_tie = [&](int i) {
        const u32 p = atomicAdd(&s.tie_cursor, 1u);
        if (p < s.take) {
            const u32 q2 = s.tie_base + p;
            if (q2 < (u32)k) orow[q2] = tk_out(s, i);
        }
    };
    // A candidate goes to its place in the cluster-wide list, in this CTA's buffer gb:
    // [eq_start[rank], eq_start[rank + 1]) is this CTA's range of it.
    auto gather = [&](int gb, u32 key, int i) {
        cand(gb)[s.eq_before + atomicAdd(&s.ncand, 1u)] = tk_pack(key, i);
    };
    // After the gather: every CTA copies the other ranks' ranges of the list into its
    // own buffer (one coalesced distributed-shared-memory read a candidate, instead of
    // C remote stores each in the filter loop), then ranks its share of the candidates:
    // candidate c goes to emitted + rank(c) when rank(c) < need (ranks by packed
    // value: distinct, exact). Ends with no CTA reading another's memory.
    auto rank_select = [&](int gb) {
        const u32 m = s.eq_tot, need = s.need, base = s.emitted;
        u64* cs = cand(gb);
        tk_cluster_sync<C>();                             // every range written
        if (C > 1) {
            for (u32 c = tid; c < m; c += THREADS) {
                u32 r = 0;
#pragma unroll
                for (int q = 1; q < C; ++q) r += c >= s.eq_start[q] ? 1u : 0u;
                if (r != (u32)rank) cs[c] = tk_load_rank64<C>(cs + c, r);
            }
            tk_cluster_sync<C>();                         // copies done everywhere
        }
        // Clusters of 4 CTAs or more share the scan among more warps (m / (C NW) candidates
        // a warp), so that the buckets' five barriers in every CTA cost more than they save
        // (measured 2-8% slower at 8 and 16 CTAs a row, B=1 and 4 decode rows).
        if (C <= 2 && m > TK_RANK_SCAN_MAX) {
            // every CTA holds the whole list now, and no other reads its histograms or
            // its other buffer: those are the buckets' scratch
            tk_bucket_rank<THREADS>(cs, m, cand(gb ^ 1), s.hist[0], s.hist[1],
                                    s.hist[0] + THREADS, s.wtot, need, base, k, orow,
                                    (u32)(tid * C + rank), (u32)(C * THREADS), tid,
                                    [&](int i) { return tk_out(s, i); });
            return;
        }
        for (u32 c = (u32)(warp * C + rank); c < m; c += NW * C) {
            const u64 me = cs[c];
            u32 cnt = 0u;
#pragma unroll 4
            for (u32 j = lane; j < m; j += 32) cnt += cs[j] > me ? 1u : 0u;
            cnt = __reduce_add_sync(0xffffffffu, cnt);
            if (lane == 0 && cnt < need) {
                const u32 p = base + cnt;
                if (p < (u32)k) orow[p] = tk_out(s, (int)~(u32)me);
            }
        }
    };

    // ---- R0: every value of the slice into the coarse histogram (n > k values in
    // the row, so the count from the top reaches k: the threshold always exists).
    for (int t = 0; t < ntiles; ++t) {
        if (t > 0) load(t);                               // tile 0: loaded above
        each(t, [&](int, float x) {
            atomicAdd(&s.hist[0][tk_coarse(x, cscale, cbias)], 1u);
        });
    }
    select(0, (u32)k, TK_ROUND);
    int hb = 0;                                          // buffer of the last select
    const u32 B0 = s.T;
    bool fin = s.fin != 0u;
    bool to_rank = !fin && s.eq_tot <= TK_RANK_MAX;
    const bool fits = s.eq_local <= CAND;
    // The filter pass: a compare a value marks (tk_marks) the few at or above R0's
    // threshold bin; one loop over the marks (re-reading those values from the cache)
    // then does what R0 decided: emit the values above the bin, and in it take the
    // ties' share, gather the list to rank, or fill the fallback's buffer (whose key
    // range the fallback finds afterwards).
    // On long slices (64 values a thread or more) the bin's float bounds
    // (tk_coarse_floor2) replace the coarse key: at or above the bin, x >= x_bin (every
    // value when B0 is 0, NaN included); above it, x >= x_above. The search cost about
    // what 32 values' coarse keys do (before tk_coarse_floor2's bracket): measured slower
    // on shorter slices.
    const float* __restrict__ qf = reinterpret_cast<const float*>(qa);
    const bool by_bounds = (long long)(v_hi - v_lo) * 4 >= 64ll * THREADS;
    float x_bin = 0.f, x_above = 0.f;
    if (by_bounds) {
        const float f = tk_coarse_floor2(B0, cscale, cbias, lane);
        x_bin = __shfl_sync(0xffffffffu, f, 0);      // -inf when B0 is 0 (NaN's bin)
        x_above = __shfl_sync(0xffffffffu, f, 16);   // NaN when B0 is the last bin
    }
    for (int t = 0; t < ntiles; ++t) {
        if (ntiles > 1) load(t);                          // one tile stays in registers
        const int base = v_lo + t * TILE;
        u32 marks = by_bounds
            ? tk_marks(vals, base + tid, THREADS, v_hi, head, n, base,
                       [&](float x) { return B0 == 0u || x >= x_bin; })
            : tk_marks(vals, base + tid, THREADS, v_hi, head, n, base,
                       [&](float x) { return tk_coarse(x, cscale, cbias) >= B0; });
        while (marks != 0u) {
            const int b = __ffs(marks) - 1;
            marks &= marks - 1u;
            const int v = v_lo + t * TILE + (b >> 2) * THREADS + tid;
            const int i = v * 4 - head + (b & 3);
            const float x = __ldg(qf + 4 * v + (b & 3));
            if (by_bounds ? x >= x_above : tk_coarse(x, cscale, cbias) > B0) {
                emit_above(i);
            } else if (fin) {
                emit_tie(i);
            } else if (to_rank) {
                gather(0, tk_key(x), i);
            } else if (fits) {
                cand(0)[atomicAdd(&s.ncand, 1u)] = tk_pack(tk_key(x), i);
            }
        }
    }
    if (to_rank) {
        rank_select(0);
        return;                                   // nobody reads another CTA's memory now
    }
    __syncthreads();

    // ---- Fallback: radix rounds on the full key, 11 bits a round from the highest
    // bit in which the keys of R0's threshold bin differ down to bit 0: the bits
    // above it are common to every candidate and need no round.
    bool src_glob = !fits;
    u32 ncur = s.eq_local;
    int cb = 0;
    // Candidates: coarse == B0 && key >> lvl_shift == P (the bits decided so far);
    // lvl_shift 32: none decided.
    int lvl_shift = 32;
    u32 P = 0u;
    // The candidates of the round: from the buffer, or (a CTA whose bin did not fit) a
    // rescan of the slice, marked (tk_marks) so that f is inlined once.
    auto for_cands = [&](auto&& f) {
        if (src_glob) {
            const float sc = s.scale, bi = s.bias;
            // two float4 a thread in flight (no tile: the registers are not there)
            for (int v0 = v_lo + tid; v0 < v_hi; v0 += 2 * THREADS) {
                float4 u[2];
#pragma unroll
                for (int j = 0; j < 2; ++j) {
                    const int v = v0 + j * THREADS;
                    u[j] = v < v_hi ? __ldg(qa + v) : make_float4(0.f, 0.f, 0.f, 0.f);
                }
                const u32 marks = tk_marks(u, v0, THREADS, v_hi, head, n, v0 - tid, [&](float x) {
                    return tk_coarse(x, sc, bi) == B0 &&
                           (lvl_shift >= 32 || (tk_key(x) >> lvl_shift) == P);
                });
                for (u32 m = marks; m != 0u; m &= m - 1u) {
                    const int b = __ffs(m) - 1;
                    const int v = v0 + (b >> 2) * THREADS;
                    f(v * 4 - head + (b & 3), tk_key(__ldg(qf + 4 * v + (b & 3))));
                }
            }
        } else {
            for (u32 c = tid; c < ncur; c += THREADS) {
                const u64 v = cand(cb)[c];
                f((int)~(u32)v, (u32)(v >> 32));
            }
        }
    };
    // The key range of R0's threshold bin (its candidates, none decided yet); not when R0
    // already decided the row (fin is alike in every CTA of a cluster: the barriers match).
    u32 kmin = 0u, kmax = 0u;
    if (!fin) {
        u32 lo = 0xFFFFFFFFu, hi = 0u;
        for_cands([&](int, u32 key) {
            lo = min(lo, key);
            hi = max(hi, key);
        });
        lo = __reduce_min_sync(0xffffffffu, lo);
        hi = __reduce_max_sync(0xffffffffu, hi);
        if (lane == 0 && lo <= hi) {
            atomicMin(&s.kmin, lo);
            atomicMax(&s.kmax, hi);
        }
        __syncthreads();
        kmin = s.kmin;
        kmax = s.kmax;
        if (C > 1) {                                  // the range over the cluster
            tk_cluster_sync<C>();
            if (warp == 0) {                          // lane r reads rank r's range
                const u32 rlo = lane < C ? tk_load_rank<C>(&s.kmin, (u32)lane) : 0xFFFFFFFFu;
                const u32 rhi = lane < C ? tk_load_rank<C>(&s.kmax, (u32)lane) : 0u;
                const u32 clo = __reduce_min_sync(0xffffffffu, rlo);
                const u32 chi = __reduce_max_sync(0xffffffffu, rhi);
                if (lane == 0) {                      // other ranks read kmin / kmax: not those
                    s.ckmin = clo;
                    s.ckmax = chi;
                }
            }
            __syncthreads();
            kmin = s.ckmin;
            kmax = s.ckmax;
        }
    }
    const u32 kx = kmin ^ kmax;
    lvl_shift = kx ? 32 - __clz(kx) : 0;
    P = lvl_shift >= 32 ? 0u : kmin >> lvl_shift;
    while (!fin) {
        const int shift = max(0, lvl_shift - 11);
        const int wbits = lvl_shift - shift;            // 0..11 (0: all keys equal)
        const u32 mask = (1u << wbits) - 1u;
        hb ^= 1;
        for (int b = tid; b < TK_BINS; b += THREADS) s.hist[hb][b] = 0u;
        __syncthreads();
        for_cands([&](int, u32 key) { atomicAdd(&s.hist[hb][(key >> shift) & mask], 1u); });
        select(hb, s.need, shift == 0 ? TK_LAST : TK_ROUND);
        const u32 T = s.T;
        fin = s.fin != 0u;
        to_rank = !fin && s.eq_tot <= TK_RANK_MAX;
        const u32 eq_local = s.eq_local;
        const bool nfits = eq_local <= CAND;
        const int nb = cb ^ 1;
        for_cands([&](int i, u32 key) {
            const u32 d = (key >> shift) & mask;
            if (d > T) {
                emit_above(i);
            } else if (d == T) {
                if (fin) {
                    emit_tie(i);
                } else if (to_rank) {
                    gather(nb, key, i);
                } else if (nfits) {
                    cand(nb)[atomicAdd(&s.ncand, 1u)] = tk_pack(key, i);
                }
            }
        });
        if (to_rank) {
            rank_select(nb);
            return;
        }
        __syncthreads();
        if (!fin) {
            P = (P << wbits) | T;                       // P is 0 while lvl_shift is 32
            lvl_shift = shift;
            src_glob = !nfits;
            ncur = eq_local;
            cb = nb;
        }
    }
    if (C > 1) tk_cluster_sync<C>();            // no CTA leaves while others read its histograms
}

// ---- Rows in shared memory (the r* variants) ---------------------------------------
// One CTA a row, its values copied into dynamic shared memory once (cp.async, every
// 16-byte unit of the row in flight at once; the launch sizes the buffer to the row
// width, topk.py): the statistics, R0, the filter pass and the fallback's rounds read
// shared memory, never global memory again. The one-CTA variants above reload their
// tiles and re-read each marked value from the cache, and spend most of a prefill
// row's time issuing instructions (Nsight Compute: 66-78% of the issue slots busy), so
// this body is written for few instructions a value:
// - units (16 bytes) wholly inside the row are processed without bounds tests (a
//   compile-time copy of each pass's body), the row's two edge units with them;
// - the coarse key of two values takes one conversion (cvt.rn.f16x2.f32), one byte
//   permute and one logic op (tk_coarse_pair); NaN shares the bin of -inf, the lowest
//   (TK_LOW_BIN): the key stays monotone in the order (NaN lowest), so the selection
//   stays exact;
// - work done once a row runs in one warp, not in every warp: the transform of the
//   coarse key (tk_adapt) and the threshold bin's float bounds (tk_coarse_floor2, in the
//   warp that found the threshold), published through shared memory;
// - the filter pass emits the values above the threshold bin without an atomic a
//   value: a first pass counts them (and handles the rare ones in the bin), one shared
//   atomic a warp takes the warp's range, and in a second pass a ballot a value slot
//   gives each lane its place, so that a warp's stores of a slot are one contiguous
//   run (each lane writing a run of its own was 24% slower: uncoalesced stores);
// - the fallback keeps no candidate buffers: each radix round re-reads the row from
//   shared memory with the candidate predicate.
// CTAs run in reverse row order: a causal prefill's rows grow with the row index, so
// the longest start first and the last wave holds short ones.

#define TK_LOW_BIN 31u     // tk_coarse_pair's lowest bin: -inf and NaN

template <bool B>
struct TkBool {
    static constexpr bool value = B;
};

// tk_coarse of two values, except that NaN goes to -inf's bin (TK_LOW_BIN) instead of 0.
__device__ __forceinline__ void tk_coarse_pair(float x0, float x1, float scale, float bias,
                                               u32& b0, u32& b1) {
    const float ninf = __int_as_float(0xff800000);
    const float y0 = fmaxf(fmaf(x0, scale, bias), ninf);      // NaN -> -inf
    const float y1 = fmaxf(fmaf(x1, scale, bias), ninf);
    u32 h, sgn;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(h) : "f"(y1), "f"(y0));   // y0: low half
    // prmt: a selector nibble with its msb set replicates the selected byte's msb, so
    // each half becomes 0xFFFF (negative) or 0x0000 (positive).
    asm("prmt.b32 %0, %1, 0, 0xBB99;" : "=r"(sgn) : "r"(h));
    const u32 key = h ^ (sgn | 0x80008000u);                   // two fp16 order keys
    b0 = (key & 0xFFFFu) >> 5;
    b1 = key >> 21;
}

// The same bin for one value (the fallback's candidate test).
__device__ __forceinline__ u32 tk_coarse_lo(float x, float scale, float bias) {
    return x != x ? TK_LOW_BIN : tk_coarse(x, scale, bias);
}

// xs[c] without a dynamically indexed array (which would live in local memory).
__device__ __forceinline__ float tk_pick(const float (&xs)[4], int c) {
    return c == 0 ? xs[0] : c == 1 ? xs[1] : c == 2 ? xs[2] : xs[3];
}

// base[j] = v, the address formed from base and j (left to itself the compiler multiplied
// the row index out again at every store of the write pass).
__device__ __forceinline__ void tk_store(int* base, u32 j, int v) {
    asm volatile("{\n\t.reg .u64 a;\n\tmad.wide.u32 a, %0, 4, %1;\n\t"
                 "st.global.b32 [a], %2;\n\t}" :: "r"(j), "l"(base), "r"(v) : "memory");
}

// Where a row's output positions go (tk_out): registers, not shared memory, here.
struct TkSlotMap {
    const int* pages;
    int cols, shift;
};

struct TkRowState {
    u32 wtot[32];
    float wmean[32];
    float wmax[32];
    u32 kmin, kmax;
    u32 cursor, tie_cursor, ncand;
    u32 T, eq_tot, eq_before, eq_local, need, emitted, above_base, tie_base, take, fin;
    float scale, bias;      // the coarse key's transform (tk_adapt, one warp)
    float x_bin, x_above;   // R0's threshold bin's float bounds (tk_coarse_floor2, one warp)
};

template <int THREADS>
__device__ __forceinline__ void tk_srow_body(TK_PARAMS) {
    constexpr int NW = THREADS / 32;
    constexpr int BPT = TK_BINS / THREADS;
    static_assert(TK_BINS % THREADS == 0, "bins per thread");
    static_assert(TK_BINS / 4 >= TK_RANK_MAX, "the rank list and its buckets live in the "
                  "histogram");
    const u32 full = 0xffffffffu;
    __shared__ TkRowState s;
    __shared__ u32 rank_scratch[2 * THREADS + 2 * NW];   // tk_bucket_rank's counts
    // The histogram of a round; once its threshold is chosen (select), the rank list
    // of packed candidates (tk_pack) until the next round clears it.
    __shared__ __align__(16) u32 hist[TK_BINS];
    u64* const list = reinterpret_cast<u64*>(hist);
    extern __shared__ __align__(16) float4 tk_row[];    // the row's 16-byte units

    const int tid = threadIdx.x;
    const int lane = tid & 31, warp = tid >> 5;
    const int row = (int)(gridDim.x - 1u - blockIdx.x);
    long long st, en;
    tk_row_window(row, width, row_starts, row_ends, context_lens, next_n, mode, st, en);
    int* __restrict__ orow = out + (long long)row * k;
    const int n = (int)(en - st);
    const TkSlotMap map = {block_table != nullptr && mode != 0
                               ? block_table + (long long)(row / next_n) * bt_cols : nullptr,
                           bt_cols, bs_shift};
    if (n <= k) {                                  // short row: 0..n-1, then -1
        for (int j = tid; j < k; j += THREADS) orow[j] = j < n ? tk_out(map, j) : -1;
        return;
    }
    // The row as 16-byte units from the aligned address at or below its start.
    const float* q = (logits + (long long)row * width) + (int)st;
    const int head = (int)((reinterpret_cast<size_t>(q) >> 2) & 3);
    const float4* qa = reinterpret_cast<const float4*>(q - head);
    const int nv = (head + n + 3) >> 2;
    {
        const u32 base = cps_smem_u32(tk_row);
        for (int v = tid; v < nv; v += THREADS) cps_cp_async16(base + 16u * v, qa + v, true);
        cps_cp_async_commit();
    }
    if (tid == 0) {
        s.need = (u32)k;
        s.emitted = 0u;
        s.kmin = 0xFFFFFFFFu;
        s.kmax = 0u;
    }
#pragma unroll
    for (int j = 0; j < BPT; ++j) hist[tid * BPT + j] = 0u;
    cps_cp_async_wait_all();
    __syncthreads();                               // the row is in shared memory

    // f(i0, xs, valid, interior) for every unit of the row: values i0 .. i0 + 3, bit c
    // of valid set when i0 + c is in [0, n); interior (TkBool<true>): all four are.
    const int vi_lo = head > 0 ? 1 : 0;            // units wholly inside: [vi_lo, vi_hi)
    const int vi_hi = (n + head) >> 2;
    // Warp-uniform: a warp's lanes take 32 consecutive units together (the emission's
    // ballots need every lane), a lane past the row with no valid value.
    auto each_unit = [&](auto&& f) {
        for (int vb = tid - lane; vb < nv; vb += THREADS) {
            const int v = vb + lane;
            const int i0 = 4 * v - head;
            if (vb >= vi_lo && vb + 32 <= vi_hi) {
                const float4 u = tk_row[v];
                const float xs[4] = {u.x, u.y, u.z, u.w};
                f(i0, xs, 0xFu, TkBool<true>());
            } else {
                const float4 u = v < nv ? tk_row[v] : make_float4(0.f, 0.f, 0.f, 0.f);
                const float xs[4] = {u.x, u.y, u.z, u.w};
                u32 valid = 0u;
#pragma unroll
                for (int c = 0; c < 4; ++c) valid |= (i0 + c >= 0 && i0 + c < n ? 1u : 0u) << c;
                f(i0, xs, valid, TkBool<false>());
            }
        }
    };

    // The coarse key's transform (tk_adapt) from the row's first THREADS units, chosen
    // by warp 0.
    tk_warp_stats(tid < nv ? tk_row[tid] : make_float4(0.f, 0.f, 0.f, 0.f), tid < nv,
                  4 * tid - head, n, lane, s.wmean[warp], s.wmax[warp]);
    __syncthreads();
    if (warp == 0) {
        float sc, bi;
        tk_adapt_warps(s.wmean, s.wmax, lane, NW, sc, bi);
        if (lane == 0) {
            s.scale = sc;
            s.bias = bi;
        }
    }
    __syncthreads();
    const float cscale = s.scale, cbias = s.bias;

    // Threshold of a round (tk_decide) from the complete histogram; with `bounds` the
    // deciding warp also finds the threshold bin's float bounds. Ends with a barrier.
    auto select = [&](u32 need, int mode, bool bounds) {
        u32 loc[BPT];
        const u32 excl = tk_round_suffix<THREADS>(s, hist, loc, tid, lane, warp);
        const bool decided = tk_decide_local(s, loc, excl, need, tid, mode);
        if (bounds && __ballot_sync(full, decided) != 0u) {
            __syncwarp();
            const u32 T = s.T;                     // >= TK_LOW_BIN >= 1
            const float f = tk_coarse_floor2(T, cscale, cbias, lane);
            if (lane == 0) s.x_bin = T > TK_LOW_BIN ? f : __int_as_float(0xff800000);
            if (lane == 16) s.x_above = f;
        }
        __syncthreads();
    };

    bool fin = false, to_rank = false;
    // A value at the round's threshold: the ties' share (fin), or the rank list
    // (to_rank), or nothing (the next round finds it again).
    auto at_threshold = [&](int i, float x) {
        if (fin) {
            const u32 t = atomicAdd(&s.tie_cursor, 1u);
            if (t < s.take && s.tie_base + t < (u32)k) orow[s.tie_base + t] = tk_out(map, i);
        } else if (to_rank) {                      // eq_tot <= TK_RANK_MAX of them
            const u32 c = atomicAdd(&s.ncand, 1u);
            if (c < TK_BINS / 2) list[c] = tk_pack(tk_key(x), i);
        }
    };
    // The round's emission: above(x) for a value above the threshold, at(x) (asked of
    // the others) for one at it; only values in the row. Pass 1 counts a thread's values
    // above (a compare and an add a value) and hands those at the threshold to
    // at_threshold (rare); one shared atomic a warp takes the warp's range. Pass 2
    // writes the values above: a ballot a value slot gives each lane its place, so a
    // warp's stores of a slot are one contiguous run (coalesced), no atomic a value.
    const u32 lt = (1u << lane) - 1u;
    auto emit = [&](auto&& above, auto&& at_thr) {
        u32 cnt = 0u;
        each_unit([&](int i0, const float (&xs)[4], u32 valid, auto interior) {
            u32 at = 0u;
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                const bool in = decltype(interior)::value || ((valid >> c) & 1u);
                const bool up = above(xs[c]);
                cnt += in && up ? 1u : 0u;
                at |= (in && !up && at_thr(xs[c]) ? 1u : 0u) << c;
            }
            while (at != 0u) {                     // rare
                const int c = __ffs(at) - 1;
                at &= at - 1u;
                at_threshold(i0 + c, tk_pick(xs, c));
            }
        });
        const u32 tot = __reduce_add_sync(full, cnt);
        u32 base = 0u;
        if (lane == 0 && tot != 0u) base = atomicAdd(&s.cursor, tot);
        base = s.above_base + __shfl_sync(full, base, 0);
        // [base, base + tot) lies in the row by construction (tk_decide: the values above
        // number less than need <= k); checked as a guard, once a warp.
        if (tot == 0u || base + tot > (u32)k) return;
        auto write = [&](auto&& slot) {
            each_unit([&](int i0, const float (&xs)[4], u32 valid, auto interior) {
#pragma unroll
                for (int c = 0; c < 4; ++c) {
                    const bool in = decltype(interior)::value || ((valid >> c) & 1u);
                    const bool up = in && above(xs[c]);
                    const u32 b = __ballot_sync(full, up);
                    if (up) tk_store(orow, base + __popc(b & lt), slot(i0 + c));
                    base += __popc(b);
                }
            });
        };
        if (map.pages == nullptr) {
            write([](int i) { return i; });
        } else {
            write([&](int i) { return tk_out(map, i); });
        }
    };

    // The rank list's candidates (eq_tot of them): candidate c goes to emitted + rank(c)
    // when rank(c) < need, ranks by packed value (distinct, exact), a warp a candidate.
    auto rank_select = [&]() {
        __syncthreads();                           // the list is complete
        const u32 m = s.eq_tot, need = s.need, base = s.emitted;
        if (m > TK_RANK_SCAN_MAX) {                // the buckets: hist's second half
            tk_bucket_rank<THREADS>(list, m, list + TK_BINS / 4, rank_scratch,
                                    rank_scratch + THREADS, rank_scratch + 2 * THREADS,
                                    s.wtot, need, base, k, orow, (u32)tid, (u32)THREADS, tid,
                                    [&](int i) { return tk_out(map, i); });
            return;
        }
        for (u32 c = (u32)warp; c < m; c += NW) {
            const u64 me = list[c];
            u32 cnt = 0u;
            for (u32 j = lane; j < m; j += 32) cnt += list[j] > me ? 1u : 0u;
            cnt = __reduce_add_sync(full, cnt);
            if (lane == 0 && cnt < need) {
                const u32 p = base + cnt;
                if (p < (u32)k) orow[p] = tk_out(map, (int)~(u32)me);
            }
        }
    };

    // ---- R0 (n > k values: the count from the top reaches k, a threshold exists).
    each_unit([&](int, const float (&xs)[4], u32 valid, auto interior) {
        u32 b[4];
        tk_coarse_pair(xs[0], xs[1], cscale, cbias, b[0], b[1]);
        tk_coarse_pair(xs[2], xs[3], cscale, cbias, b[2], b[3]);
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            if (decltype(interior)::value || ((valid >> c) & 1u)) atomicAdd(&hist[b[c]], 1u);
        }
    });
    select((u32)k, TK_ROUND, true);
    const u32 B0 = s.T;
    fin = s.fin != 0u;
    to_rank = !fin && s.eq_tot <= TK_RANK_MAX;
    {   // above the bin: x >= x_above (never NaN); in it: the rest down to x_bin, or
        // everything left when it is the lowest bin (-inf and NaN)
        const float x_bin = s.x_bin, x_above = s.x_above;
        const bool low = B0 == TK_LOW_BIN;
        emit([&](float x) { return x >= x_above; }, [&](float x) { return low || x >= x_bin; });
    }
    if (to_rank) {
        rank_select();
        return;
    }
    if (fin) return;
    __syncthreads();

    // ---- The fallback's radix rounds on the full key over R0's threshold bin, 11 bits
    // a round from the highest bit in which its keys differ; a candidate of a round is
    // a value of the bin whose key agrees with the bits decided so far (P above
    // lvl_shift). Rare: the transform is re-read from shared memory.
    const float fscale = s.scale, fbias = s.bias;
    {
        u32 lo = 0xFFFFFFFFu, hi = 0u;
        each_unit([&](int, const float (&xs)[4], u32 valid, auto) {
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                if (((valid >> c) & 1u) && tk_coarse_lo(xs[c], fscale, fbias) == B0) {
                    lo = min(lo, tk_key(xs[c]));
                    hi = max(hi, tk_key(xs[c]));
                }
            }
        });
        lo = __reduce_min_sync(full, lo);
        hi = __reduce_max_sync(full, hi);
        if (lane == 0 && lo <= hi) {
            atomicMin(&s.kmin, lo);
            atomicMax(&s.kmax, hi);
        }
        __syncthreads();
    }
    const u32 kx = s.kmin ^ s.kmax;
    int lvl_shift = kx ? 32 - __clz(kx) : 0;
    u32 P = lvl_shift >= 32 ? 0u : s.kmin >> lvl_shift;
    while (!fin) {
        const int shift = max(0, lvl_shift - 11);
        const int wbits = lvl_shift - shift;      // 0..11 (0: all keys equal)
        const u32 mask = (1u << wbits) - 1u;
        auto digit = [&](float x) -> int {        // -1: not a candidate
            if (tk_coarse_lo(x, fscale, fbias) != B0) return -1;
            const u32 key = tk_key(x);
            if (lvl_shift < 32 && (key >> lvl_shift) != P) return -1;
            return (int)((key >> shift) & mask);
        };
#pragma unroll
        for (int j = 0; j < BPT; ++j) hist[tid * BPT + j] = 0u;   // no loop state to keep
        __syncthreads();
        each_unit([&](int, const float (&xs)[4], u32 valid, auto) {
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                const int d = ((valid >> c) & 1u) ? digit(xs[c]) : -1;
                if (d >= 0) atomicAdd(&hist[d], 1u);
            }
        });
        select(s.need, shift == 0 ? TK_LAST : TK_ROUND, false);
        const int T = (int)s.T;
        fin = s.fin != 0u;
        to_rank = !fin && s.eq_tot <= TK_RANK_MAX;
        emit([&](float x) { return digit(x) > T; }, [&](float x) { return digit(x) == T; });
        if (to_rank) {
            rank_select();
            return;
        }
        __syncthreads();
        P = (P << wbits) | (u32)T;                // P is 0 while lvl_shift is 32
        lvl_shift = shift;
    }
}

// One entry point per configuration. mode 0: windows [row_starts, row_ends);
// mode 1: decode, row_starts 0, row (b, j) ends at L_b - next_n + j + 1 with
// context_lens [B]; mode 2: context_lens [B, next_n] gives each row's end.
// Unused pointer arguments may be any device array. block_table (decode modes
// only; NULL otherwise) makes the rows global cache slots (tk_out). Grid:
// rows * C CTAs, C consecutive CTAs a row (a cluster); dynamic shared memory
// 2 * CAND * 8 bytes (topk.py's VARIANTS; TK_CAND_* are #defined by topk.py).
#define TK_KERNEL(THREADS, VEC, C, CAND, MINB, SUFFIX, ATTR)                                \
    extern "C" __global__ void ATTR __launch_bounds__(THREADS, MINB)                        \
    cps_topk_##SUFFIX(TK_PARAMS) {                                                          \
        CPS_PDL_WAIT();                                                                     \
        tk_body<THREADS, VEC, C, CAND>(TK_ARGS);                                            \
    }

// The cluster variants run one CTA an SM (choose_cluster keeps their grid within one
// wave): their register budget is 128 a thread, where c1 and c1_t256 share an SM.
TK_KERNEL(512, 4, 1, TK_CAND_ONE_CTA, 2, c1, )
TK_KERNEL(256, 4, 1, TK_CAND_ONE_CTA, 4, c1_t256, )
TK_KERNEL(512, 8, 2, TK_CAND_CLUSTER, 1, c2, __cluster_dims__(2, 1, 1))
TK_KERNEL(512, 8, 4, TK_CAND_CLUSTER, 1, c4, __cluster_dims__(4, 1, 1))
TK_KERNEL(512, 8, 8, TK_CAND_CLUSTER, 1, c8, __cluster_dims__(8, 1, 1))
TK_KERNEL(512, 4, 16, TK_CAND_CLUSTER, 1, c16, __cluster_dims__(16, 1, 1))

// Rows in shared memory: grid = rows, dynamic shared memory = the row buffer
// (16 * ((width + 6) / 4) bytes: up to 3 values before the row and 3 after it).
#define TK_SROW_KERNEL(THREADS, MINB, SUFFIX)                                               \
    extern "C" __global__ void __launch_bounds__(THREADS, MINB)                             \
    cps_topk_##SUFFIX(TK_PARAMS) {                                                          \
        CPS_PDL_WAIT();                                                                     \
        tk_srow_body<THREADS>(TK_ARGS);                                                     \
    }

// 256 threads, five CTAs an SM (48 registers; a 32 KB row buffer at width 8192): 512
// threads and 128 were slower on every shape measured (performance.md).
TK_SROW_KERNEL(256, 5, r256)
