/* xxh3-64 for shardkit's kernels, from the vendored xxHash (csrc/xxhash, BSD-2-Clause).
 *
 * Everything is inlined into the including module. On x86 the bulk routines go through
 * xxHash's runtime dispatcher (xxh_x86dispatch.c, compiled into the same extension), which
 * picks SSE2, AVX2 or AVX-512 for the running CPU, as the xxhash package does; digests are the
 * same on every path. */
#ifndef SHARDKIT_XXH3_H
#define SHARDKIT_XXH3_H

#define XXH_INLINE_ALL
#include "xxhash/xxhash.h"
#ifdef SHARDKIT_XXH_DISPATCH
#include "xxhash/xxh_x86dispatch.h"
#endif

#endif
