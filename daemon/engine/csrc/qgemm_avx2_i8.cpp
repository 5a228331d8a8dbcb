// Part QG_PART_AVX2_I8 of qgemm.cpp: the int8 products of AVX2.
// An object of its own, so that the kernel's parts compile at once (see qgemm.cpp).
#define QG_PART_AVX2_I8 1
#include "qgemm.cpp"
