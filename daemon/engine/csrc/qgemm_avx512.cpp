// Part QG_PART_AVX512 of qgemm.cpp: the widening (exact) products of AVX-512.
// An object of its own, so that the kernel's parts compile at once (see qgemm.cpp).
#define QG_PART_AVX512 1
#include "qgemm.cpp"
