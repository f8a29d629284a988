// Native row kernel of difftest.compare.rowstats: every per-row statistic of a (reference, engine)
// pair of [R, C] row-major tensors from one read of each tensor from memory; and, at the end of
// this file, the float64 sums of difftest.compare.noise.row_rel_err (the calibration's comparison).
//
// The definition is difftest/compare/rowstats.py's eager path (_elementwise, _sums, _rank_tv); this
// file computes the same numbers. Counts, maxima, max_col and rank are exact; sums are float32
// within a block of BLOCK columns and float64 across blocks (closer to exact than the eager float32
// sums).
//
// Why it is fast:
//  * rows are spread over threads, and a row is swept up to three times, but only the first sweep
//    reads it from DRAM: a 163840-wide bf16 row pair is 640 KiB and is still in L2 (or L3) for the
//    two softmax sweeps;
//  * every value is an 8-float GCC vector-extension value, lowered to one AVX2 register (the
//    "x86-64-v3" build: -mavx2 -mfma -mf16c) or two SSE registers (the "generic" build; rowkernel.py
//    picks the build from torch's CPU capability), so one source is the fast path and the fallback;
//  * the common case is cheap and the rare one exact: a block of columns with no NaN/inf (and no
//    square overflowing float32) needs none of the non-finite masks, and its float32 sums of squares
//    say whether it had any; a block whose sums are not finite is recomputed with the full rules.
//    The softmax sweeps likewise (see Kind): rows sweep 1 found all finite need no masks, rows with
//    -inf (logits outside a draft vocabulary) but no NaN/+inf only KL's p_ref > 0 mask, and only
//    the rest every rule.
//
// Build flags must include -ffp-contract=off: GCC would otherwise fuse `atol + rtol * |ref|` into
// one FMA, whose single rounding can flip an element that sits exactly on the tolerance boundary
// relative to torch's separately rounded mul and add. FMAs are used explicitly (fmadd) where only
// a sum's last bit is at stake. No -ffast-math: NaN/inf semantics are the statistics' subject.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <new>
#include <thread>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define DIFFTEST_V3 1
#endif

namespace {

typedef float f8 __attribute__((vector_size(32)));
typedef int32_t i8 __attribute__((vector_size(32)));
typedef uint32_t u8 __attribute__((vector_size(32)));
typedef uint16_t u16x8 __attribute__((vector_size(16)));
typedef _Float16 h8 __attribute__((vector_size(16)));
typedef double d8 __attribute__((vector_size(64)));

constexpr int W = 8;             // lanes
constexpr int64_t BLOCK = 2048;  // columns summed in float32 before the float64 row total
// rows up to this wide keep their softmax numerators between sweeps 2 and 3 (8 MiB per thread at
// most); wider ones, which do not stay in cache anyway, compute them twice
constexpr int64_t SCRATCH_MAX_COLS = int64_t{1} << 20;
constexpr float INF = std::numeric_limits<float>::infinity();
constexpr float QNAN = std::numeric_limits<float>::quiet_NaN();

inline f8 splat(float x) { return f8{x, x, x, x, x, x, x, x}; }
inline i8 splati(int32_t x) { return i8{x, x, x, x, x, x, x, x}; }
inline f8 vabs(f8 x) { return (f8)((i8)x & splati(0x7fffffff)); }
inline f8 keep(i8 m, f8 x) { return (f8)(m & (i8)x); }  // x where m, else +0
// x86 max semantics (the second operand where either is NaN): one vmaxps. For NaN-free values.
inline f8 vmax(f8 a, f8 b) { return a > b ? a : b; }
// NaN-propagating maximum, as torch.amax: once NaN, a lane stays NaN.
inline f8 nanmax(f8 m, f8 x) { return ((x > m) | (x != x)) ? x : m; }
inline f8 fmadd(f8 a, f8 b, f8 c) {
#ifdef DIFFTEST_V3
    return (f8)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
    return a * b + c;  // two roundings where there is no FMA unit: sums only, see the header
#endif
}

// dtype codes shared with rowkernel.py
enum : int { F32 = 0, BF16 = 1, F16 = 2, F64 = 3 };

template <int D> struct Src;
template <> struct Src<F32> {
    using T = float;
    static f8 load(const T* p) { f8 v; std::memcpy(&v, p, sizeof v); return v; }
};
template <> struct Src<BF16> {  // bf16 is the upper half of a float32
    using T = uint16_t;
    static f8 load(const T* p) {
#ifdef DIFFTEST_V3
        return (f8)_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16);
#else
        u16x8 h;
        std::memcpy(&h, p, sizeof h);
        return (f8)(__builtin_convertvector(h, u8) << 16);
#endif
    }
};
template <> struct Src<F16> {
    using T = _Float16;
    static f8 load(const T* p) {
#ifdef DIFFTEST_V3
        return (f8)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p));
#else
        h8 h;  // libgcc's conversion, lane by lane
        std::memcpy(&h, p, sizeof h);
        return __builtin_convertvector(h, f8);
#endif
    }
};
template <> struct Src<F64> {  // the eager path compares float64 as float32 too (.float())
    using T = double;
    static f8 load(const T* p) { d8 d; std::memcpy(&d, p, sizeof d); return __builtin_convertvector(d, f8); }
};

// exp for float32 lanes. GCC does not vectorise expf without -ffast-math, which this file cannot
// use, so: exp(x) = 2^n e^r with n = round(x / ln 2) (by adding 1.5 * 2^23, which leaves n in the
// low mantissa bits), r = x - n ln 2 in [-ln2/2, ln2/2] (ln 2 split in two so that n * LN2_HI is
// exact), e^r by a degree-6 polynomial fitted for relative error on that interval (9e-8 in float32
// arithmetic: 1-2 ulp overall). Subnormal results come out as subnormals, not 0: exp(-100) > 0
// matters to KL's `p_ref > 0` rule, as it does in torch.
constexpr float MAGIC = 12582912.0f;  // 1.5 * 2^23
constexpr int32_t MAGIC_BITS = 0x4b400000;

inline f8 exp_poly(f8 r) {
    f8 p = splat(1.384361996e-03f);
    p = fmadd(p, r, splat(8.374149911e-03f));
    p = fmadd(p, r, splat(4.166800156e-02f));
    p = fmadd(p, r, splat(1.666643173e-01f));
    p = fmadd(p, r, splat(4.999999404e-01f));
    p = fmadd(p, r, splat(1.0f));
    return fmadd(p, r, splat(1.0f));
}

// exp(x) for x <= 0 or -inf, never NaN (x - max over a row with a finite max): 2^n applied as
// 2^(n+64) (a normal float for n in [-150, 0]) times 2^-64, whose one rounding makes the subnormals.
inline f8 exp_nonpositive(f8 x) {
    const f8 xc = vmax(x, splat(-104.0f));  // e^-104 is below half the smallest subnormal: 0
    const f8 t = fmadd(xc, splat(1.44269504088896341f), splat(MAGIC));
    const f8 n = t - splat(MAGIC);
    f8 r = fmadd(n, splat(-0.693359375f), xc);
    r = fmadd(n, splat(2.12194440e-4f), r);
    const f8 scale = (f8)(((i8)t + (127 + 64 - MAGIC_BITS)) << 23);
    return exp_poly(r) * scale * splat(0x1p-64f);
}

// exp(x) for any x (NaN and +inf included): the rare rows' path.
inline f8 exp_any(f8 x) {
    const i8 nan = x != x;
    f8 xc = vmax(x, splat(-104.0f));  // NaN becomes -104 here, and NaN again at the end
    xc = xc < splat(89.0f) ? xc : splat(89.0f);  // e^89 > FLT_MAX: inf
    const f8 t = fmadd(xc, splat(1.44269504088896341f), splat(MAGIC));
    const f8 n = t - splat(MAGIC);
    f8 r = fmadd(n, splat(-0.693359375f), xc);
    r = fmadd(n, splat(2.12194440e-4f), r);
    const i8 k = (i8)t - MAGIC_BITS;  // in [-150, 129]: as two factors 2^k1 2^k2, each a normal float
    const i8 k1 = k >> 1, k2 = k - k1;
    const f8 y = exp_poly(r) * (f8)((k1 + 127) << 23) * (f8)((k2 + 127) << 23);
    return nan ? x : y;
}

inline double hsum(f8 v) {
    double s = 0.0;
    for (int i = 0; i < W; ++i) s += (double)v[i];
    return s;
}
inline int64_t hsumi(i8 v) {
    int64_t s = 0;
    for (int i = 0; i < W; ++i) s += v[i];
    return s;
}
inline float hmax(f8 v) {  // NaN-free values
    float m = v[0];
    for (int i = 1; i < W; ++i) m = v[i] > m ? v[i] : m;
    return m;
}
inline float hnanmax(f8 v) {
    float m = v[0];
    for (int i = 1; i < W; ++i)
        if (v[i] > m || v[i] != v[i]) m = v[i];
    return m;
}

const i8 IOTA = {0, 1, 2, 3, 4, 5, 6, 7};
const i8 ALL = {-1, -1, -1, -1, -1, -1, -1, -1};

// f(x, y, valid, c) on every 8 columns of [c0, c1); the last group is zero-padded, valid = 0 there.
template <int D, class F>
inline void for_vectors(const typename Src<D>::T* a, const typename Src<D>::T* b, int64_t c0, int64_t c1, F&& f) {
    using T = typename Src<D>::T;
    int64_t c = c0;
    for (; c + W <= c1; c += W) f(Src<D>::load(a + c), Src<D>::load(b + c), ALL, c);
    if (c < c1) {
        T ta[W], tb[W];
        std::memset(ta, 0, sizeof ta);
        std::memset(tb, 0, sizeof tb);
        std::memcpy(ta, a + c, (c1 - c) * sizeof(T));
        std::memcpy(tb, b + c, (c1 - c) * sizeof(T));
        f(Src<D>::load(ta), Src<D>::load(tb), IOTA < splati((int32_t)(c1 - c)), c);
    }
}

// The elementwise statistics of a block of columns (and of a row, summed over blocks).
struct Stats {
    double s_abs = 0, s_sq = 0, s_ab = 0, s_aa = 0, s_bb = 0;
    int64_t mism = 0, nonfin = 0, nan_a = 0, nan_b = 0, inf_a = 0, inf_b = 0;
    float max_abs = -1.0f, max_rel = 0.0f, ma = -INF, mb = -INF;

    void add(const Stats& o) {
        s_abs += o.s_abs, s_sq += o.s_sq, s_ab += o.s_ab, s_aa += o.s_aa, s_bb += o.s_bb;
        mism += o.mism, nonfin += o.nonfin, nan_a += o.nan_a, nan_b += o.nan_b, inf_a += o.inf_a, inf_b += o.inf_b;
        max_rel = std::max(max_rel, o.max_rel);
        ma = (o.ma > ma || o.ma != o.ma) ? o.ma : ma;
        mb = (o.mb > mb || o.mb != o.mb) ? o.mb : mb;
    }
};

// The eager rule's |a - b| (0 for equal values, infinities included; NaN as +inf), the value
// max_abs and max_col are taken over.
inline f8 diff_rule(f8 x, f8 y) {
    const f8 d = vabs(x - y);
    return (x == y) ? splat(0.0f) : ((d != d) ? splat(INF) : d);
}

// A block with every value finite: no masks. Returns false (and the caller recomputes the block
// with exact_block) if its float32 sums of squares are not finite: the case whenever a value is
// NaN/inf, and also when a square overflows float32 (harmless: exact_block gives the same numbers).
template <int D>
bool finite_block(const typename Src<D>::T* a, const typename Src<D>::T* b, int64_t c0, int64_t c1, float atol,
                  float rtol, bool logits, Stats& s) {
    f8 s_abs{}, s_sq{}, s_ab{}, s_aa{}, s_bb{}, vmx = splat(-1.0f), vrel{}, ma = splat(-INF), mb = splat(-INF);
    i8 mism{};
    const f8 vatol = splat(atol), vrtol = splat(rtol), zero = splat(0.0f);
    for_vectors<D>(a, b, c0, c1, [&](f8 x, f8 y, i8 valid, int64_t) __attribute__((always_inline)) {
        const f8 d = vabs(x - y), ax = vabs(x);
        mism -= d > vatol + vrtol * ax;  // for finite values: not (same or d <= tol)
        vmx = vmax(d, vmx);
        s_abs += d;
        s_sq = fmadd(d, d, s_sq);
        s_ab = fmadd(x, y, s_ab);
        s_aa = fmadd(x, x, s_aa);
        s_bb = fmadd(y, y, s_bb);
        vrel = vmax(keep(ax > zero, d / ax), vrel);
        if (logits) {  // the zero padding must not raise a maximum
            ma = vmax(valid ? x : splat(-INF), ma);
            mb = vmax(valid ? y : splat(-INF), mb);
        }
    });
    s.s_aa = hsum(s_aa), s.s_bb = hsum(s_bb);
    if (!std::isfinite(s.s_aa) || !std::isfinite(s.s_bb)) return false;
    s.s_abs = hsum(s_abs), s.s_sq = hsum(s_sq), s.s_ab = hsum(s_ab);
    s.mism = hsumi(mism);
    s.max_abs = hmax(vmx), s.max_rel = hmax(vrel);
    if (logits) s.ma = hmax(ma), s.mb = hmax(mb);
    return true;
}

// Any block, with the eager path's rules in full (see rowstats._elementwise).
template <int D>
void exact_block(const typename Src<D>::T* a, const typename Src<D>::T* b, int64_t c0, int64_t c1, float atol,
                 float rtol, bool logits, Stats& s) {
    f8 s_abs{}, s_sq{}, s_ab{}, s_aa{}, s_bb{}, vmx = splat(-1.0f), vrel{}, ma = splat(-INF), mb = splat(-INF);
    i8 mism{}, nonfin{}, nan_a{}, nan_b{}, inf_a{}, inf_b{};
    const f8 vatol = splat(atol), vrtol = splat(rtol), vinf = splat(INF), zero = splat(0.0f);
    for_vectors<D>(a, b, c0, c1, [&](f8 x, f8 y, i8 valid, int64_t) __attribute__((always_inline)) {
        const i8 same = x == y;  // equal values, equal infinities included; never NaN
        const f8 ax = vabs(x), ay = vabs(y);
        const i8 fin = (ax < vinf) & (ay < vinf);
        const f8 d = diff_rule(x, y);
        const i8 close = same | (fin & (d <= vatol + vrtol * ax));
        mism -= ~close;  // the zero padding is equal, finite and close: it counts nowhere
        nonfin -= ~fin & ~same;
        nan_a -= x != x;
        nan_b -= y != y;
        inf_a -= ax == vinf;
        inf_b -= ay == vinf;
        vmx = vmax(d, vmx);
        const f8 df = keep(fin, d), xf = keep(fin, x), yf = keep(fin, y);
        s_abs += df;
        s_sq = fmadd(df, df, s_sq);
        s_ab = fmadd(xf, yf, s_ab);
        s_aa = fmadd(xf, xf, s_aa);
        s_bb = fmadd(yf, yf, s_bb);
        vrel = vmax(keep(fin & (ax > zero), d / ax), vrel);
        if (logits) {
            ma = nanmax(ma, valid ? x : -vinf);
            mb = nanmax(mb, valid ? y : -vinf);
        }
    });
    s.s_abs = hsum(s_abs), s.s_sq = hsum(s_sq), s.s_ab = hsum(s_ab), s.s_aa = hsum(s_aa), s.s_bb = hsum(s_bb);
    s.mism = hsumi(mism), s.nonfin = hsumi(nonfin);
    s.nan_a = hsumi(nan_a), s.nan_b = hsumi(nan_b), s.inf_a = hsumi(inf_a), s.inf_b = hsumi(inf_b);
    s.max_abs = hmax(vmx), s.max_rel = hmax(vrel);
    if (logits) s.ma = hnanmax(ma), s.mb = hnanmax(mb);
}

// The first column of [c0, c1) whose difference (diff_rule) is m, the block's greatest.
template <int D>
int64_t first_col(const typename Src<D>::T* a, const typename Src<D>::T* b, int64_t c0, int64_t c1, float m) {
    int64_t found = -1;
    for_vectors<D>(a, b, c0, c1, [&](f8 x, f8 y, i8 valid, int64_t c) {
        if (found >= 0) return;
        const i8 hit = valid & (diff_rule(x, y) == splat(m));
        for (int i = 0; i < W; ++i)
            if (hit[i]) {
                found = c + i;
                return;
            }
    });
    return found;
}

// Output fields, one float64 / int64 array of R values each; the order is rowkernel.py's.
enum { O_MAX_ABS, O_SUM_ABS, O_SUM_SQ, O_SUM_AB, O_SUM_AA, O_SUM_BB, O_MAX_REL, O_KL, O_TV, N_FLOAT };
enum { O_MAX_COL, O_MISMATCHED, O_NONFINITE, O_NAN_A, O_NAN_B, O_INF_A, O_INF_B, O_RANK, N_INT };

struct Out {
    double* f;
    int64_t* i;
    int64_t R;
    void set(int field, int64_t r, double v) const { f[field * R + r] = v; }
    void seti(int field, int64_t r, int64_t v) const { i[field * R + r] = v; }
};

// How much of the NaN/inf machinery a row's softmax sweeps need, from what sweep 1 saw:
//  CLEAN:    every value finite (and no square overflowed): exp arguments are finite and <= 0, and
//            W needs no p_ref > 0 mask (a - b is finite). Exp arguments below -87 give ~1e-38
//            instead of a subnormal or 0, nothing a float32 sum of terms up to 1 can hold.
//  ORDINARY: maxima finite and no NaN in b, -inf allowed (logits outside a draft vocabulary): exp
//            arguments are <= 0 or -inf; subnormals exact, W masked where p_ref == 0.
//  ANY:      the rest (NaN, +inf): every rule in full, NaN-propagating maxima.
enum Kind { CLEAN, ORDINARY, ANY };

// exp(x) for finite x <= 0 whose result only enters sums: 2^n as one exponent field.
inline f8 exp_clean(f8 x) {
    const f8 xc = vmax(x, splat(-87.0f));  // keeps 2^n a normal float
    const f8 t = fmadd(xc, splat(1.44269504088896341f), splat(MAGIC));
    const f8 n = t - splat(MAGIC);
    f8 r = fmadd(n, splat(-0.693359375f), xc);
    r = fmadd(n, splat(2.12194440e-4f), r);
    return exp_poly(r) * (f8)(((i8)t + (127 - MAGIC_BITS)) << 23);
}

// The engine's logit at the reference's top-1 (the greatest over tied top-1s), from the blocks of
// columns whose greatest reference logit is ma (block_max: sweep 1's, per block): one block
// to read, typically, instead of a blend and a max per vector in sweep 2. NaN-free rows only.
template <int D>
float logit_at_top1(const typename Src<D>::T* a, const typename Src<D>::T* b, int64_t C, float fa,
                    const std::vector<float>& block_max) {
    f8 vat = splat(-INF);
    for (size_t k = 0; k < block_max.size(); ++k) {
        if (block_max[k] != fa) continue;
        const int64_t c0 = (int64_t)k * BLOCK;
        for_vectors<D>(a, b, c0, std::min(C, c0 + BLOCK), [&](f8 x, f8 y, i8 valid, int64_t) {
            vat = vmax((valid & (x == splat(fa))) ? y : splat(-INF), vat);
        });
    }
    return hmax(vat);
}

// Softmax sweeps 2 and 3 of one row whose maxima fa, fb are known. scratch: room for 2 x C
// (rounded up to W) floats, or null: sweep 2 keeps exp(a - ma) and exp(b - mb) there so that
// sweep 3 need not compute them again (two exps are most of its work, 2.4x the time measured;
// the scratch is one row pair per thread, and stays in L2/L3 as the row does).
template <int D, Kind K>
void softmax(const typename Src<D>::T* a, const typename Src<D>::T* b, int64_t C, float fa, float fb,
             const std::vector<float>& block_max, float* scratch, const Out& o, int64_t r) {
    const f8 ma = splat(fa), mb = splat(fb), zero = splat(0.0f), ninf = splat(-INF);
    auto ex = [](f8 x) __attribute__((always_inline)) {
        return K == CLEAN ? exp_clean(x) : K == ORDINARY ? exp_nonpositive(x) : exp_any(x);
    };
    const int64_t half = (C + W - 1) / W * W;
    float* const sa = scratch;
    float* const sb = scratch ? scratch + half : nullptr;
    // sweep 2: S_a, S_b, W = sum exp(a - ma) (a - b) (KL = W / S_a - (lse_a - lse_b)), and for
    // ANY rows the engine's logit at the reference's top-1
    double t_a = 0, t_b = 0, t_w = 0;
    f8 vat = ninf;
    for (int64_t c0 = 0; c0 < C; c0 += BLOCK) {
        f8 s_a{}, s_b{}, s_w{};
        for_vectors<D>(a, b, c0, std::min(C, c0 + BLOCK), [&](f8 x, f8 y, i8 valid, int64_t c) __attribute__((always_inline)) {
            const f8 ea = keep(valid, ex(x - ma)), eb = keep(valid, ex(y - mb));
            if (scratch) {
                std::memcpy(sa + c, &ea, sizeof ea);
                std::memcpy(sb + c, &eb, sizeof eb);
            }
            s_a += ea;
            s_b += eb;
            if (K == CLEAN)
                s_w = fmadd(ea, x - y, s_w);
            else
                s_w += keep(ea > zero, ea * (x - y));  // 0 * inf where p_ref == 0 is masked
            if (K == ANY) vat = nanmax(vat, (valid & (x == ma)) ? y : ninf);
        });
        t_a += hsum(s_a), t_b += hsum(s_b), t_w += hsum(s_w);
    }
    const float at = K == ANY ? hnanmax(vat) : logit_at_top1<D>(a, b, C, fa, block_max);
    // lse_a - lse_b = (ma - mb) + (log S_a - log S_b) in float64 (see rowstats._softmax_rest)
    double kl = t_w / t_a - (((double)fa - (double)fb) + (std::log(t_a) - std::log(t_b)));
    if (kl < 0.0) kl = 0.0;  // >= 0 in exact arithmetic; NaN stays NaN (as torch's clamp_min)
    o.set(O_KL, r, kl);

    // sweep 3: the rank of the reference's top-1 among the engine's logits, and total variation
    const f8 ia = splat((float)(1.0 / t_a)), ib = splat((float)(1.0 / t_b)), vat8 = splat(at);
    double t_tv = 0;
    int64_t t_rank = 0;
    for (int64_t c0 = 0; c0 < C; c0 += BLOCK) {
        f8 s_tv{};
        i8 rank{};
        for_vectors<D>(a, b, c0, std::min(C, c0 + BLOCK), [&](f8 x, f8 y, i8 valid, int64_t c) __attribute__((always_inline)) {
            f8 ea, eb;
            if (scratch) {
                std::memcpy(&ea, sa + c, sizeof ea);
                std::memcpy(&eb, sb + c, sizeof eb);
            } else {
                ea = ex(x - ma), eb = ex(y - mb);
            }
            s_tv += keep(valid, vabs(fmadd(ea, ia, -(eb * ib))));
            rank -= valid & (y > vat8);
        });
        t_tv += hsum(s_tv), t_rank += hsumi(rank);
    }
    o.set(O_TV, r, 0.5 * t_tv);
    o.seti(O_RANK, r, t_rank);
}

template <int D>
void row(const typename Src<D>::T* a, const typename Src<D>::T* b, int64_t C, float atol, float rtol, bool logits,
         float* scratch, const Out& o, int64_t r) {
    // sweep 1 (from DRAM): the elementwise statistics and the row maxima, block by block; after a
    // block that needed the exact rules the next one starts with them (rows of -inf spans)
    Stats row;
    int64_t col = 0;
    bool exact = false, any_exact = false;
    std::vector<float> block_max;
    if (logits) block_max.reserve((C + BLOCK - 1) / BLOCK);
    for (int64_t c0 = 0; c0 < C; c0 += BLOCK) {
        const int64_t c1 = std::min(C, c0 + BLOCK);
        Stats s;
        const bool fast = !exact && finite_block<D>(a, b, c0, c1, atol, rtol, logits, s);
        if (!fast) {
            s = Stats();
            exact_block<D>(a, b, c0, c1, atol, rtol, logits, s);
            exact = s.nan_a + s.nan_b + s.inf_a + s.inf_b > 0;
            any_exact = true;
        }
        if (s.max_abs > row.max_abs) {  // strict: an earlier block keeps a tie
            row.max_abs = s.max_abs;
            col = first_col<D>(a, b, c0, c1, s.max_abs);
        }
        if (logits) block_max.push_back(s.ma);
        row.add(s);
    }
    o.set(O_MAX_ABS, r, row.max_abs), o.seti(O_MAX_COL, r, col);
    o.set(O_SUM_ABS, r, row.s_abs), o.set(O_SUM_SQ, r, row.s_sq), o.set(O_SUM_AB, r, row.s_ab);
    o.set(O_SUM_AA, r, row.s_aa), o.set(O_SUM_BB, r, row.s_bb), o.set(O_MAX_REL, r, row.max_rel);
    o.seti(O_MISMATCHED, r, row.mism), o.seti(O_NONFINITE, r, row.nonfin);
    o.seti(O_NAN_A, r, row.nan_a), o.seti(O_NAN_B, r, row.nan_b);
    o.seti(O_INF_A, r, row.inf_a), o.seti(O_INF_B, r, row.inf_b);
    if (!logits) return;
    if (!any_exact)  // every block was finite_block's: no NaN/inf, no overflowing square
        softmax<D, CLEAN>(a, b, C, row.ma, row.mb, block_max, scratch, o, r);
    else if (std::isfinite(row.ma) && std::isfinite(row.mb) && row.nan_b == 0)
        softmax<D, ORDINARY>(a, b, C, row.ma, row.mb, block_max, scratch, o, r);
    else
        softmax<D, ANY>(a, b, C, row.ma, row.mb, block_max, scratch, o, r);
}

// fn(r) for every row r < R on `threads` threads (this one included); rows are handed out in
// groups of ~64K elements: few atomic operations, and a balanced end. Every thread first makes
// its own state (make_state(), e.g. scratch) and passes it to fn.
template <class Make, class Fn>
void parallel_rows(int64_t R, int64_t C, int threads, Make&& make_state, Fn&& fn) {
    threads = (int)std::max<int64_t>(1, std::min<int64_t>(threads, R));
    const int64_t group = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(C, 1));
    std::atomic<int64_t> next{0};
    auto work = [&]() {
        auto state = make_state();
        for (;;) {
            const int64_t r0 = next.fetch_add(group);
            if (r0 >= R) return;
            for (int64_t r = r0; r < std::min(R, r0 + group); ++r) fn(r, state);
        }
    };
    std::vector<std::thread> pool;
    for (int t = 1; t < threads; ++t) {
        try {
            pool.emplace_back(work);
        } catch (...) {  // no more threads to be had: the ones started (and this one) do the rest
            break;
        }
    }
    work();
    for (auto& t : pool) t.join();
}

template <class Fn>
void parallel_rows(int64_t R, int64_t C, int threads, Fn&& fn) {
    parallel_rows(R, C, threads, [] { return 0; }, [&](int64_t r, int) { fn(r); });
}

template <int D>
void rows(const void* a, const void* b, int64_t stride_a, int64_t stride_b, int64_t R, int64_t C, float atol,
          float rtol, bool logits, int threads, const Out& o) {
    using T = typename Src<D>::T;
    const T* pa = static_cast<const T*>(a);
    const T* pb = static_cast<const T*>(b);
    auto scratch = [&]() {
        std::vector<float> s;
        if (logits && C <= SCRATCH_MAX_COLS) {
            try {
                s.resize(2 * ((C + W - 1) / W * W));
            } catch (const std::bad_alloc&) {  // computed twice instead
            }
        }
        return s;
    };
    parallel_rows(R, C, threads, scratch, [&](int64_t r, std::vector<float>& s) {
        row<D>(pa + r * stride_a, pb + r * stride_b, C, atol, rtol, logits, s.empty() ? nullptr : s.data(), o, r);
    });
}

// ---- noise.row_rel_err: per row, in float64, sum (x - ref)^2 and sum ref^2 over the elements
// where both are finite and differ, and the count of elements where one is NaN/inf and they
// differ. Float64 lanes, 4 to a 256-bit register; one sweep from DRAM. The same split as above: a
// block whose plain sums are finite had no NaN/inf (and no square overflowing float64), otherwise
// it is recomputed with the rule's masks.
typedef double d4 __attribute__((vector_size(32)));
typedef int64_t l4 __attribute__((vector_size(32)));
typedef float f4 __attribute__((vector_size(16)));
typedef uint16_t u16x4 __attribute__((vector_size(8)));
typedef uint32_t u4 __attribute__((vector_size(16)));
typedef _Float16 h4 __attribute__((vector_size(8)));

template <int D> d4 load4(const typename Src<D>::T* p);
template <> d4 load4<F64>(const double* p) { d4 v; std::memcpy(&v, p, sizeof v); return v; }
template <> d4 load4<F32>(const float* p) { f4 v; std::memcpy(&v, p, sizeof v); return __builtin_convertvector(v, d4); }
template <> d4 load4<BF16>(const uint16_t* p) {
    u16x4 h;
    std::memcpy(&h, p, sizeof h);
    return __builtin_convertvector((f4)(__builtin_convertvector(h, u4) << 16), d4);
}
template <> d4 load4<F16>(const _Float16* p) {
#ifdef DIFFTEST_V3  // GCC converts half to double lane by lane in software; F16C gives floats
    return __builtin_convertvector((f4)_mm_cvtph_ps(_mm_loadl_epi64((const __m128i*)p)), d4);
#else
    h4 h;
    std::memcpy(&h, p, sizeof h);
    return __builtin_convertvector(__builtin_convertvector(h, f4), d4);
#endif
}

inline d4 dfmadd(d4 a, d4 b, d4 c) {
#ifdef DIFFTEST_V3
    return (d4)_mm256_fmadd_pd((__m256d)a, (__m256d)b, (__m256d)c);
#else
    return a * b + c;
#endif
}
inline double hsum4(d4 v) { return (v[0] + v[1]) + (v[2] + v[3]); }

// f(x, r, c) on every 4 columns of [c0, c1), the last group zero-padded (0 == 0: it adds nothing).
template <int DX, int DR, class F>
inline void for_vectors4(const typename Src<DX>::T* x, const typename Src<DR>::T* r, int64_t c0, int64_t c1, F&& f) {
    int64_t c = c0;
    for (; c + 4 <= c1; c += 4) f(load4<DX>(x + c), load4<DR>(r + c));
    if (c < c1) {
        typename Src<DX>::T tx[4];
        typename Src<DR>::T tr[4];
        std::memset(tx, 0, sizeof tx);
        std::memset(tr, 0, sizeof tr);
        std::memcpy(tx, x + c, (c1 - c) * sizeof(tx[0]));
        std::memcpy(tr, r + c, (c1 - c) * sizeof(tr[0]));
        f(load4<DX>(tx), load4<DR>(tr));
    }
}

template <int DX, int DR>
void rel_err_row(const typename Src<DX>::T* x, const typename Src<DR>::T* r, int64_t C, double* num, double* den,
                 int64_t* bad) {
    double t_num = 0, t_den = 0;
    int64_t t_bad = 0;
    for (int64_t c0 = 0; c0 < C; c0 += BLOCK) {
        const int64_t c1 = std::min(C, c0 + BLOCK);
        d4 s_num{}, s_den{};
        for_vectors4<DX, DR>(x, r, c0, c1, [&](d4 a, d4 b) __attribute__((always_inline)) {
            const d4 d = a - b;
            s_num = dfmadd(d, d, s_num);
            s_den = dfmadd(b, b, s_den);
        });
        double b_num = hsum4(s_num), b_den = hsum4(s_den);
        if (!std::isfinite(b_num) || !std::isfinite(b_den)) {
            const double dinf = std::numeric_limits<double>::infinity();
            const d4 inf = {dinf, dinf, dinf, dinf}, zero{};
            l4 n_bad{};
            s_num = s_den = zero;
            for_vectors4<DX, DR>(x, r, c0, c1, [&](d4 a, d4 b) __attribute__((always_inline)) {
                const l4 same = a == b;
                const l4 fin = (((d4)((l4)a & INT64_MAX)) < inf) & (((d4)((l4)b & INT64_MAX)) < inf);
                const d4 d = (d4)(((l4)(a - b)) & (fin & ~same));
                const d4 bf = (d4)((l4)b & fin);
                s_num = dfmadd(d, d, s_num);
                s_den = dfmadd(bf, bf, s_den);
                n_bad -= ~same & ~fin;
            });
            b_num = hsum4(s_num), b_den = hsum4(s_den);
            t_bad += n_bad[0] + n_bad[1] + n_bad[2] + n_bad[3];
        }
        t_num += b_num, t_den += b_den;
    }
    *num = t_num, *den = t_den, *bad = t_bad;
}

template <int DX, int DR>
void rel_err_rows(const void* x, const void* r, int64_t stride_x, int64_t stride_r, int64_t R, int64_t C, int threads,
                  double* num, double* den, int64_t* bad) {
    const auto* px = static_cast<const typename Src<DX>::T*>(x);
    const auto* pr = static_cast<const typename Src<DR>::T*>(r);
    parallel_rows(R, C, threads, [&](int64_t i) {
        rel_err_row<DX, DR>(px + i * stride_x, pr + i * stride_r, C, num + i, den + i, bad + i);
    });
}

template <int DX>
int rel_err_dispatch(int dtype_r, const void* x, const void* r, int64_t sx, int64_t sr, int64_t R, int64_t C,
                     int threads, double* num, double* den, int64_t* bad) {
    switch (dtype_r) {
        case F32: rel_err_rows<DX, F32>(x, r, sx, sr, R, C, threads, num, den, bad); return 0;
        case BF16: rel_err_rows<DX, BF16>(x, r, sx, sr, R, C, threads, num, den, bad); return 0;
        case F16: rel_err_rows<DX, F16>(x, r, sx, sr, R, C, threads, num, den, bad); return 0;
        case F64: rel_err_rows<DX, F64>(x, r, sx, sr, R, C, threads, num, den, bad); return 0;
        default: return -1;
    }
}

}  // namespace

extern "C" {

// Bumped whenever the signature or the output layout changes; rowkernel.py checks it.
int difftest_rowkernel_abi(void) { return 2; }

// a, b: [R, C] of one dtype (F32/BF16/F16/F64), unit column stride, row strides in elements,
// 0 < C < 2^31. fout: N_FLOAT x R float64, iout: N_INT x R int64 (field-major; kl, tv and rank
// are written for logits only). Returns 0, or -1 for a dtype this file does not handle.
int difftest_row_stats(const void* a, const void* b, int dtype, int64_t stride_a, int64_t stride_b, int64_t R,
                       int64_t C, float atol, float rtol, int logits, int threads, double* fout, int64_t* iout) {
    const Out o{fout, iout, R};
    switch (dtype) {
        case F32: rows<F32>(a, b, stride_a, stride_b, R, C, atol, rtol, logits, threads, o); return 0;
        case BF16: rows<BF16>(a, b, stride_a, stride_b, R, C, atol, rtol, logits, threads, o); return 0;
        case F16: rows<F16>(a, b, stride_a, stride_b, R, C, atol, rtol, logits, threads, o); return 0;
        case F64: rows<F64>(a, b, stride_a, stride_b, R, C, atol, rtol, logits, threads, o); return 0;
        default: return -1;
    }
}

// x, ref: [R, C] of any two dtypes (F32/BF16/F16/F64), unit column stride, row strides in
// elements. num, den: float64 [R]; bad: int64 [R] (see rel_err_row). Returns 0, or -1 for a dtype
// this file does not handle.
int difftest_rel_err(const void* x, int dtype_x, const void* ref, int dtype_ref, int64_t stride_x, int64_t stride_ref,
                     int64_t R, int64_t C, int threads, double* num, double* den, int64_t* bad) {
    switch (dtype_x) {
        case F32: return rel_err_dispatch<F32>(dtype_ref, x, ref, stride_x, stride_ref, R, C, threads, num, den, bad);
        case BF16: return rel_err_dispatch<BF16>(dtype_ref, x, ref, stride_x, stride_ref, R, C, threads, num, den, bad);
        case F16: return rel_err_dispatch<F16>(dtype_ref, x, ref, stride_x, stride_ref, R, C, threads, num, den, bad);
        case F64: return rel_err_dispatch<F64>(dtype_ref, x, ref, stride_x, stride_ref, R, C, threads, num, den, bad);
        default: return -1;
    }
}

}  // extern "C"
