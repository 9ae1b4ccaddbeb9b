"""Register-level building blocks of the sm_90 KIVI decode kernel (`kivi_decode_sm90`).

The kernel composes these fragments, most of them inline Mosaic GPU (`plgpu.inline_mgpu`
bodies that write out the per-thread registers, addresses and PTX), into its decode loop. They
are grouped by purpose; import them from their modules:

- `layout`: the tile geometry and register layout (PLANE, WG_LAYOUT), SMEM swizzles, the
  widen8 contraction order (PERM16), the cache order's token maps and the numeric constants of
  the kernel's scaling;
- `inline`: helpers for inline Mosaic GPU bodies (i32 constants, lane and warp ids, register
  maps, the in-register 8x8 transpose);
- `codes`: code bytes -> fp16/fp8 code fields (magic-number, subnormal and e4m3 fields, the
  widened code tile);
- `mma`: mma.sync operands and products, and the pack_planes lane selects;
- `smem`: SMEM <-> register fragments (vector and tile loads, stores of P and the bias rows,
  the per-warp value codes, zeroing, the query tile's prologue);
- `reduce`: warp and warpgroup reductions and barriers;
- `pipeline`: the TMA pipeline of one warpgroup without automatic barriers;
- `epilogue`: the in-kernel log-sum-exp merge of a row's splits.

Where a function takes `interpret`, that path computes the same in jnp under the Pallas
interpreter; functions without it that build inline Mosaic GPU are native only (each module's
docstring says which). This package re-exports nothing: a flat namespace would put the
functions `mma` and `pipeline` over the submodules of the same names.
"""
