/* Vector e^x for x <= 0 (scores less their max), 8 and 16 lanes: the one definition the softmax
 * kernels share (_paged_decode.c, _causal_softmax.c). Include after <immintrin.h> where the
 * includer defines AVX2 and AVX512 as its target attributes.
 *
 * e^x = 2^n * p(r), n = round(x / ln 2), r = x - n ln 2 in [-ln2/2, ln2/2] (ln 2 split in two
 * for the subtraction), p of degree 6 (relative error ~1e-7); below -87 the result is 0. One
 * body for both widths: V the vector type, the rest its intrinsics. */
#ifndef KVSTRATA_VEC_EXP_H
#define KVSTRATA_VEC_EXP_H

#define EXP_BODY(V, SET1, FMADD, FNMADD, MUL, MAX, ROUND, CVT, CAST, SLLI, ADDI)                 \
    x = MAX(x, SET1(-87.0f));                                                                   \
    V n = ROUND(MUL(x, SET1(1.44269504088896341f)));                                            \
    V r = FNMADD(n, SET1(0.693359375f), x);                                                     \
    r = FNMADD(n, SET1(-2.12194440e-4f), r);                                                    \
    V p = SET1(1.0f / 720);                                                                     \
    p = FMADD(p, r, SET1(1.0f / 120));                                                          \
    p = FMADD(p, r, SET1(1.0f / 24));                                                           \
    p = FMADD(p, r, SET1(1.0f / 6));                                                            \
    p = FMADD(p, r, SET1(0.5f));                                                                \
    p = FMADD(p, r, SET1(1.0f));                                                                \
    p = FMADD(p, r, SET1(1.0f));                                                                \
    V two_n = CAST(SLLI(ADDI(CVT(n), 127), 23));

#define R256(v) _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define ADD256(v, c) _mm256_add_epi32(v, _mm256_set1_epi32(c))
#define R512(v) _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define ADD512(v, c) _mm512_add_epi32(v, _mm512_set1_epi32(c))

AVX2 static inline __m256 exp8(__m256 x) {
    __m256 zero = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_LT_OQ);
    EXP_BODY(__m256, _mm256_set1_ps, _mm256_fmadd_ps, _mm256_fnmadd_ps, _mm256_mul_ps,
             _mm256_max_ps, R256, _mm256_cvtps_epi32, _mm256_castsi256_ps, _mm256_slli_epi32,
             ADD256)
    return _mm256_andnot_ps(zero, _mm256_mul_ps(p, two_n));
}

AVX512 static inline __m512 exp16(__m512 x) {
    __mmask16 zero = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_LT_OQ);
    EXP_BODY(__m512, _mm512_set1_ps, _mm512_fmadd_ps, _mm512_fnmadd_ps, _mm512_mul_ps,
             _mm512_max_ps, R512, _mm512_cvtps_epi32, _mm512_castsi512_ps, _mm512_slli_epi32,
             ADD512)
    return _mm512_maskz_mul_ps((__mmask16)~zero, p, two_n);
}

#endif
