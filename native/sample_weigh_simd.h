// sample::exp_gap's polynomial (sample_weigh.h) on a vector of doubles, written once over a traits type D (V, set1,
// add, mul): the same operations in the same order as the scalar code, each rounded on its own. Included inside a
// variant's target region, after `#pragma GCC optimize("fp-contract=off")` and its traits (ops_avx2.cc,
// ops_avx512.cc), so the instantiations get the region's instructions and no fused multiply-add.

// a + b r
template <class D>
inline typename D::V sample_pair(double a, double b, typename D::V r) {
  return D::add(D::set1(a), D::mul(D::set1(b), r));
}

template <class D>
inline typename D::V sample_estrin(typename D::V r) {
  using V = typename D::V;
  const V r2 = D::mul(r, r), r4 = D::mul(r2, r2), r8 = D::mul(r4, r4);
  const V p01 = D::add(D::set1(1.0), r);
  const V p23 = sample_pair<D>(sample::kC2, sample::kC3, r), p45 = sample_pair<D>(sample::kC4, sample::kC5, r);
  const V p67 = sample_pair<D>(sample::kC6, sample::kC7, r), p89 = sample_pair<D>(sample::kC8, sample::kC9, r);
  const V p1011 = sample_pair<D>(sample::kC10, sample::kC11, r), p1213 = sample_pair<D>(sample::kC12, sample::kC13, r);
  // low = ((1 + r) + (c2 + c3 r) r2) + ((c4 + c5 r) + (c6 + c7 r) r2) r4
  const V low = D::add(D::add(p01, D::mul(p23, r2)), D::mul(D::add(p45, D::mul(p67, r2)), r4));
  // high = ((c8 + c9 r) + (c10 + c11 r) r2) + (c12 + c13 r) r4
  const V high = D::add(D::add(p89, D::mul(p1011, r2)), D::mul(p1213, r4));
  return D::add(low, D::mul(high, r8));
}
