// Included first in every unit of metrale's native CPU kernels (cpu_kernels.py prepends it): the
// instruction-set macros and the per-class op namespace.
#pragma once
// The ops the units call, each by its own header: ATen/ATen.h (every op's) was most of a unit's compile time.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/mm.h>
#include <torch/library.h>

#if defined(__SSE__)
#include <xmmintrin.h>
#endif
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define METRALE_AVX512 1
#endif
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define METRALE_AVX2 1
#endif

// Each instruction-set class's build registers its ops under its own namespace (cpu_kernels.py passes
// -DMETRALE_NS=metrale_cpu_<class>), so several builds load side by side. The extra macro level expands
// METRALE_NS before TORCH_LIBRARY pastes it into names.
#ifndef METRALE_NS
#define METRALE_NS metrale_cpu
#endif
#define METRALE_LIBRARY_(ns, m) TORCH_LIBRARY(ns, m)
#define METRALE_LIBRARY(m) METRALE_LIBRARY_(METRALE_NS, m)
#define METRALE_FRAGMENT_(ns, m) TORCH_LIBRARY_FRAGMENT(ns, m)
#define METRALE_FRAGMENT(m) METRALE_FRAGMENT_(METRALE_NS, m)

