// bfloat16 expert products on AMX tiles (Intel Xeon from Sapphire Rapids on), for groups of token
// rows past what the skinny products (skinny_gemm.h) serve.
//
// PyTorch's bfloat16 GEMM reaches AMX through oneDNN, which repacks the whole matrix into tile
// layout on every call: for an expert multiplying 8-256 token rows the repacking costs about as
// much as the product.  AMX multiplies C[m][n] += sum_k A[m][k] B[k][n] with A taken as plain rows
// (16 rows of 32 values) and only B with its pairs of rows interleaved.
//
// - [O, K] matrices (F.linear's layout): the matrix serves as A straight from memory.  The
//   products compute y^T = W x^T, repack only the token rows (x, small beside W) and transpose
//   the 16 x 16 blocks of sums on their way out.  From 128 token rows each work item packs its
//   matrix rows as B tiles once instead, the token rows are A tiles and the sums come out as
//   token rows.
// - [K, O] matrices (x @ W): the token rows serve as A (copied once into tiles).  Up to 16 token
//   rows the matrix serves as B straight from memory, its rows' neighbouring values taken as the
//   pairs and the token rows spread over alternate lanes to match (twice the tile products, no
//   pass over the matrix beforehand); with more rows it is read once per product, in chunks of
//   rows across each work item's columns, and interleaved into B tiles as it streams.
//
// Read in place, a NaN or infinite matrix value W[k][c] also makes output c ^ 1 of every token
// row NaN (its lane meets the spread rows' zeros); everywhere else a NaN reaches only its own
// output, as in any GEMM.
//
// Sums run in float (AMX's bfloat16 products are exact; each sums its pairs in float, and
// subnormal inputs and results count as zero), rounded to bfloat16 once at the end as
// Scalar<bfloat16>::store does.
#pragma once

#include <cstdint>
#include <vector>

#include "skinny_gemm.h"

namespace tutel {
namespace gemm {

// Whether this build and CPU run tile products: AMX-BF16 and AVX-512 present, and the operating
// system grants this process the tile registers (Linux is asked once).
bool tile_products_available();

// Runs every product (all with `inner`, `outputs` and `layout` in common, as skinny_products, any
// number of rows), splitting their outputs over the threads.  Only where tile_products_available().
void tile_products(const std::vector<SkinnyProduct<bfloat16>>& products, int64_t inner, int64_t outputs,
                   WeightLayout layout);

}  // namespace gemm
}  // namespace tutel
