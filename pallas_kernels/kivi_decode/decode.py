"""`kivi_decode`: the public call of the KIVI decode kernel (input checks, the query's prologue
where the kernel does not run it, the launch, the merge of the splits and of the sinks)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.kivi_decode.config import (
    MAX_PADDED_HEADS,
    SMEM_LIMIT,
    SUPPORTED_BITS,
    SUPPORTED_GROUPS,
    SUPPORTED_HEAD_DIMS,
    Plan,
    TuningConfig,
    call_tuning,
    launch_smem,
    value_channel_order,
)
from pallas_kernels.kivi_decode.kernel import VCH, build_kernel
from pallas_kernels.merge import mask_logits, merge_partials
from pallas_kernels.rotation import hadamard_rotation, rotate_rows, unrotate_rows
from pallas_kernels.sm90.layout import PLANE, permute_contraction

_MMA_DTYPE = jnp.float16  # fp16 operands: 3 more mantissa bits than bf16 for the codes


def check_inputs(
    q,
    k_codes,
    k_scale,
    k_min,
    v_codes,
    v_scale,
    v_min,
    num_tokens,
    layer,
    key_bits,
    value_bits,
    group_size,
):
    """Validates shapes and dtypes; returns (L, B, Hq, Hkv, D, Tq)."""
    for name, bits in (("key_bits", key_bits), ("value_bits", value_bits)):
        if bits not in SUPPORTED_BITS:
            raise NotImplementedError(f"{name}={bits}: only {SUPPORTED_BITS} are supported")
    if group_size not in SUPPORTED_GROUPS:
        raise NotImplementedError(f"group_size={group_size}: only {SUPPORTED_GROUPS} are supported")
    if q.ndim != 3:
        raise ValueError(f"q must be [B, Hq, D], got shape {q.shape}")
    if jnp.dtype(q.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        raise NotImplementedError(f"q dtype {q.dtype}: only bfloat16 and float16 are supported")
    B, Hq, D = q.shape
    if D not in SUPPORTED_HEAD_DIMS:
        raise NotImplementedError(f"head dim D={D}: only {SUPPORTED_HEAD_DIMS} are supported")
    if D % group_size:
        raise ValueError(f"group_size={group_size} must divide the head dim D={D} (value groups)")
    if k_codes.ndim != 5:
        raise ValueError(f"k_codes must be [L, B, Hkv, Tq/Pk, D], got shape {k_codes.shape}")
    L, _, Hkv, _, _ = k_codes.shape
    Pk, Pv = 8 // key_bits, 8 // value_bits
    Tq = k_codes.shape[3] * Pk
    if Hkv < 1 or Hq % Hkv:
        raise ValueError(f"q heads Hq={Hq} must be a multiple of the kv heads Hkv={Hkv}")
    if Tq % 256 or Tq == 0:
        raise ValueError(
            f"quantized capacity Tq={Tq} (from k_codes) must be a positive multiple of 256"
        )
    expect = {
        "k_codes": ((L, B, Hkv, Tq // Pk, D), jnp.uint8),
        "k_scale": ((L, B, Hkv, Tq // group_size, D), jnp.float16),
        "k_min": ((L, B, Hkv, Tq // group_size, D), jnp.float16),
        "v_codes": (
            (
                (L, B, Hkv, Tq // Pv // PLANE, D, PLANE)
                if v_codes.ndim == 6
                else (L, B, Hkv, D, Tq // Pv)
            ),
            jnp.uint8,
        ),
        "v_scale": ((L, B, Hkv, D // group_size, Tq), jnp.float16),
        "v_min": ((L, B, Hkv, D // group_size, Tq), jnp.float16),
    }
    got = dict(
        k_codes=k_codes, k_scale=k_scale, k_min=k_min, v_codes=v_codes, v_scale=v_scale, v_min=v_min
    )
    for name, (shape, dtype) in expect.items():
        x = got[name]
        if tuple(x.shape) != shape:
            raise ValueError(
                f"{name} must have shape {shape} (docs/layout.md), got {tuple(x.shape)}"
            )
        if jnp.dtype(x.dtype) != jnp.dtype(dtype):
            raise ValueError(f"{name} must have dtype {jnp.dtype(dtype).name}, got {x.dtype}")
    nt_type = jnp.result_type(num_tokens)
    if tuple(jnp.shape(num_tokens)) != (B,) or not jnp.issubdtype(nt_type, jnp.integer):
        raise ValueError(f"num_tokens must be an int32 [B={B}] array, got {jnp.shape(num_tokens)}")
    if jnp.ndim(layer) != 0 or not jnp.issubdtype(jnp.result_type(layer), jnp.integer):
        raise ValueError(f"layer must be an integer scalar, got {layer!r}")
    if not isinstance(layer, jax.core.Tracer) and not 0 <= int(layer) < L:
        raise ValueError(f"layer must be in [0, {L}), got {int(layer)}")  # traced: o is NaN
    if Hq // Hkv > MAX_PADDED_HEADS:
        raise NotImplementedError(
            f"Hq/Hkv={Hq // Hkv} query heads per kv head (max {MAX_PADDED_HEADS})"
        )
    return L, B, Hq, Hkv, D, Tq


WINDOW_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
OUT_DTYPES = (jnp.dtype(jnp.float32), *WINDOW_DTYPES)


def check_out_dtype(out_dtype) -> jnp.dtype:
    try:
        dt = jnp.dtype(out_dtype)
    except TypeError:
        dt = None
    if dt not in OUT_DTYPES:
        raise ValueError(f"out_dtype must be float32, bfloat16 or float16, got {out_dtype!r}")
    return dt


def _check_skip(skip) -> int:
    if not isinstance(skip, int) or isinstance(skip, bool) or skip < 0:
        raise ValueError(f"skip must be a non-negative int, got {skip!r}")
    return skip


def check_windows(windows, L, B, Hkv, D) -> int:
    """Validates the residual windows (k_window [L, B, Hkv, W, D], v_window [L, B, Hkv, D, W],
    one 16-bit dtype, W a positive multiple of 64); returns W."""
    if not isinstance(windows, tuple | list) or len(windows) != 2:
        raise ValueError("windows must be a pair (k_window, v_window)")
    kw, vw = windows
    if getattr(kw, "ndim", None) != 5 or tuple(kw.shape[:3]) != (L, B, Hkv) or kw.shape[4] != D:
        raise ValueError(f"k_window must be [L={L}, B={B}, Hkv={Hkv}, W, D={D}], got {kw.shape}")
    W = kw.shape[3]
    if W < PLANE or W % PLANE:
        raise NotImplementedError(f"window W={W}: only positive multiples of {PLANE}")
    if getattr(vw, "shape", None) != (L, B, Hkv, D, W):
        raise ValueError(f"v_window must be [L, B, Hkv, D, W] = {(L, B, Hkv, D, W)}")
    if jnp.dtype(kw.dtype) not in WINDOW_DTYPES or kw.dtype != vw.dtype:
        raise NotImplementedError(
            f"windows of {kw.dtype} / {vw.dtype}: one dtype, bfloat16 or float16"
        )
    return W


def check_sinks(sinks, L, B, Hkv, D, skip) -> int:
    """Validates the sinks (k_sink [L, B, Hkv, N, D], v_sink the same shape, float) against
    `skip`, which must be N; returns N."""
    if not isinstance(sinks, tuple | list) or len(sinks) != 2:
        raise ValueError("sinks must be a pair (k_sink, v_sink)")
    ks, vs = sinks
    if getattr(ks, "ndim", None) != 5 or tuple(ks.shape[:3]) != (L, B, Hkv) or ks.shape[4] != D:
        raise ValueError(f"k_sink must be [L={L}, B={B}, Hkv={Hkv}, N, D={D}], got {ks.shape}")
    N = ks.shape[3]
    if getattr(vs, "shape", None) != ks.shape:
        raise ValueError(f"v_sink must be k_sink's shape {ks.shape}, got {vs.shape}")
    for x, name in ((ks, "k_sink"), (vs, "v_sink")):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(f"{name} must be floating point, got {x.dtype}")
    if skip != N:
        raise ValueError(f"with {N} sinks skip must be {N} (their codes are not attended)")
    return N


def quantized_positions(num_tokens, Tq: int, window: int = 0, max_len: int = 0):
    """[B] int32: the positions [0, n) of each row that a call reads from the codes: num_tokens
    (at most Tq), or with `window` slots in the launch the rows' lengths (capped at max_len)
    less the window's, as the kernel counts them."""
    n = jnp.asarray(num_tokens, jnp.int32)
    if not window:
        return jnp.minimum(n, Tq)
    if max_len:
        n = jnp.minimum(n, max_len)
    return jnp.clip(n - window, 0, Tq)


def check_signs(signs, D) -> tuple[float, ...] | None:
    """Validates the rotation's signs (`kivi_decode`'s q_signs): None, or D values each +1 or
    -1 (D a power of two); returns them as a tuple of floats (a static argument)."""
    if signs is None:
        return None
    signs = tuple(float(x) for x in np.asarray(signs).reshape(-1))
    if len(signs) != D:
        raise ValueError(f"q_signs must hold D={D} signs, got {len(signs)}")
    hadamard_rotation(signs)  # raises ValueError for other values or D
    return signs


def sinks_in_kernel(sinks, window: int, window_dtype) -> bool:
    """Whether the kernel attends the sinks itself, as one more 64-slot chunk of its window
    unit: with the windows in the launch, N a multiple of 8 up to 64 (the keys land in whole
    8-row tiles of a chunk's key buffer) and the sinks in the windows' dtype. Otherwise they
    are merged with the splits outside (`sink_keys`)."""
    ks, vs = sinks
    N = ks.shape[3]
    dt = jnp.dtype(window_dtype)
    return bool(window) and N % 8 == 0 and 0 < N <= PLANE and ks.dtype == vs.dtype == dt


def sink_operands(sinks, layer):
    """The kernel's sink operands: k_sink [L, B, Hkv, N, D] as it is (TMA copies its N rows)
    and `layer`'s values as a window chunk, transposed and padded to 64 slots
    [B, Hkv, D, 64] (a zero value where no sink is: the chunk's masked slots weigh 0)."""
    ks, vs = sinks
    v = jax.lax.dynamic_index_in_dim(vs, layer, 0, keepdims=False)  # [B, Hkv, N, D]
    pad = PLANE - v.shape[2]
    return ks, jnp.pad(jnp.swapaxes(v, -1, -2), ((0, 0), (0, 0), (0, 0), (0, pad)))


def sink_keys(q, sinks, layer, sm_scale, held) -> tuple[jax.Array, jax.Array]:
    """The sinks of `layer` as single keys for `merge_partials`: logits [B, Hkv, N, nq] of q
    [B, Hq, D] (float32, times sm_scale: natural-log units, as the kernel's lse), those past
    each row's `held` [B] count masked, and values [B, Hkv, N, 1, D] float32.
    Multiply-and-reduce over N (small), which XLA fuses into the merge (as GEMMs they would
    launch on their own)."""
    ks, vs = sinks
    B, Hq, D = q.shape
    Hkv, N = ks.shape[2], ks.shape[3]
    take = lambda x: jax.lax.dynamic_index_in_dim(x, layer, 0, keepdims=False).astype(jnp.float32)
    qs = q.astype(jnp.float32).reshape(B, Hkv, 1, Hq // Hkv, D) * sm_scale
    s = jnp.sum(qs * take(ks)[:, :, :, None], axis=-1)  # [B, Hkv, N, nq]
    on = jnp.arange(N)[None, :] < jnp.asarray(held)[:, None]  # [B, N]
    return mask_logits(s, on[:, None, :, None]), take(vs)[:, :, :, None]


def rotated_query(q, signs):
    """q [B, Hq, D] in float32, rotated by the keys' rotation of `signs` (None: as it is)."""
    return q.astype(jnp.float32) if signs is None else rotate_rows(q, signs)


def q_operand(q, plan: Plan, sm_scale):
    """q [B, Hq, D] -> the key product's B tiles [B, Hkv, 1, NP, D] fp16: rotated
    (`plan.q_signs`) and times sm_scale in float32, the padded heads zero (pack_planes without
    pack_zeros: q's heads repeated in columns 4-7), natively the byte-permuted contraction
    order. What the kernel does itself with q_prologue."""
    B, Hq, D = q.shape
    Hkv, nq, NP = plan.Hkv, plan.nq, plan.NP
    qf = (rotated_query(q, plan.q_signs) * sm_scale).reshape(B, Hkv, nq, D)
    qf = jnp.pad(qf, ((0, 0), (0, 0), (0, NP - nq), (0, 0)))
    qf = qf.astype(_MMA_DTYPE)
    if plan.native:  # key tile channels in the _PERM16 order
        qf = permute_contraction(qf)
    qf = jnp.swapaxes(qf.reshape(B, Hkv, NP, 1, D), 2, 3)
    if plan.pk and not plan.tuning.pack_zeros:  # q's heads also in columns 4-7: B for both
        qf = qf + jnp.roll(qf, 4, axis=3)
    return qf


def kernel_call(
    q,
    cache,
    num_tokens,
    layer,
    *,
    key_bits,
    value_bits,
    group_size,
    sm_scale,
    tuning,
    interpret,
    windows=None,
    max_len=0,
    skip=0,
    sinks=None,
    out_dtype="float32",
    q_signs=None,
    o_signs=None,
):
    """The kernel of `kivi_decode` and its operands: (kern, args, plan); kern(*args) ->
    (o_parts [B, Hkv, S, D, NP], lse_parts [B, Hkv, S, NP]) before the merge (with the
    in-kernel merge, the merged (o [B, Hkv, D, NP], lse [B, Hkv, NP]), or where nothing is
    merged after the launch (`plan.out_dtype` set) o [B, Hkv, nq, D] in `out_dtype`). The
    sinks are the kernel's operands where it attends them (`sinks_in_kernel`, then
    `plan.sinks` = N), else left to the caller's merge (`plan.sinks` = 0)."""
    L, B, Hq, Hkv, D, Tq = check_inputs(
        q, *cache, num_tokens, layer, key_bits, value_bits, group_size
    )
    W = 0 if windows is None else check_windows(windows, L, B, Hkv, D)
    window_dtype = jnp.dtype(windows[0].dtype).name if W else "bfloat16"
    own_sinks = sinks is not None and sinks_in_kernel(sinks, W, window_dtype)
    plan = Plan(
        tuning=tuning,
        B=B,
        Hkv=Hkv,
        nq=Hq // Hkv,
        D=D,
        Tq=Tq,
        L=L,
        key_bits=key_bits,
        value_bits=value_bits,
        G=group_size,
        interpret=interpret,
        vblock=cache[3].ndim == 6,
        window=W,
        window_dtype=window_dtype,
        length_cap=max_len if W else 0,
        skip=skip,
        sinks=sinks[0].shape[3] if own_sinks else 0,
        q_signs=q_signs,
    )
    if plan.cluster and (sinks is None or own_sinks):  # the kernel writes the final rows,
        # rotated back from the values' basis there too
        plan = dataclasses.replace(plan, out_dtype=jnp.dtype(out_dtype).name, o_signs=o_signs)
    # sm_scale is applied in float32 before the cast to the fp16 operand; the kernel works in
    # log2 units (exp2 without a multiply; ln s_t as log2 s_t), so log2(e) goes in with it.
    sm_scale = sm_scale * float(np.log2(np.e))
    if plan.q_in_kernel:
        qf, q_scale = q.reshape(B, Hkv, plan.nq, D), sm_scale  # the kernel's own prologue
    else:
        qf, q_scale = q_operand(q, plan, sm_scale), None
    # the layer and the row lengths as operands of their own: no concatenation to run per call
    layer1 = jnp.asarray(layer, jnp.int32).reshape(1)
    num_tokens = jnp.asarray(num_tokens, jnp.int32).reshape(B)
    k_codes, k_scale, k_min, v_codes, v_scale, v_min = cache
    v_scale = v_scale.reshape(*v_scale.shape[:-1], Tq // VCH, VCH)  # free: splits minor dim
    v_min = v_min.reshape(*v_min.shape[:-1], Tq // VCH, VCH)
    cache = (k_codes, k_scale, k_min, v_codes, v_scale, v_min)
    args = (layer1, num_tokens, qf, *cache)
    if W:  # the caller's q (unless qf is already that; rotated, once rounded to the
        # windows' dtype, unless the kernel rotates it), then the windows
        qr = lambda: rotated_query(q, q_signs).astype(window_dtype) if q_signs else q
        raw = () if plan.q_in_kernel else (qr().reshape(B, Hkv, plan.nq, D),)
        args = (*args, *raw, *windows)
    if own_sinks:
        args = (*args, *sink_operands(sinks, layer))
    return build_kernel(plan, q_scale, sm_scale if W else None), args, plan


@functools.partial(
    jax.jit,
    static_argnames=(
        "key_bits",
        "value_bits",
        "group_size",
        "sm_scale",
        "tuning",
        "interpret",
        "max_len",
        "skip",
        "out_dtype",
        "q_signs",
        "o_signs",
    ),
)
def _kivi_decode(
    q,
    cache,
    num_tokens,
    layer,
    windows,
    sinks,
    *,
    max_len,
    skip,
    key_bits,
    value_bits,
    group_size,
    sm_scale,
    tuning,
    interpret,
    out_dtype,
    q_signs,
    o_signs,
):
    kern, args, plan = kernel_call(
        q,
        cache,
        num_tokens,
        layer,
        key_bits=key_bits,
        value_bits=value_bits,
        group_size=group_size,
        sm_scale=sm_scale,
        tuning=tuning,
        interpret=interpret,
        windows=windows,
        max_len=max_len,
        skip=skip,
        sinks=sinks,
        out_dtype=out_dtype,
        q_signs=q_signs,
        o_signs=o_signs,
    )
    o, lse = kern(*args)
    B, Hq, D = q.shape
    if plan.out_dtype:  # the rows as the caller takes them, [B, Hkv, nq, D]
        return o.reshape(B, Hq, D), lse[..., : plan.nq].reshape(B, Hq)
    if plan.cluster:  # merged in the kernel: one part [B, Hkv, 1, D, NP]
        o, lse = o[:, :, None], lse[:, :, None]
    nq = plan.nq  # the parts' real heads (NP pads them), [B, Hkv, S, nq, D]
    o, lse = jnp.swapaxes(o, -1, -2)[:, :, :, :nq], lse[:, :, :, :nq]
    # fold_v_warp: the parts' channels in the warps' order, put back once merged (a
    # gather of the output, not of every part); the sinks' values join in that order
    rows = value_channel_order(plan)
    keys = None
    if sinks is not None and not plan.sinks:  # merged here: those below the codes' split
        n = quantized_positions(num_tokens, plan.Tq, plan.window, plan.length_cap)
        held = jnp.minimum(n, sinks[0].shape[3])
        keys = sink_keys(rotated_query(q, q_signs), sinks, layer, sm_scale, held)
        if rows is not None:
            keys = (keys[0], jnp.take(keys[1], rows, axis=-1))
    if plan.cluster and keys is None:
        o, lse = o[:, :, 0], lse[:, :, 0]
    else:  # the splits and the sinks in one pass
        o, lse = merge_partials(o, lse, axis=2, keys=keys)
    if rows is not None:
        o = jnp.take(o, np.argsort(rows), axis=-1)
    if o_signs is not None:  # out of the values' basis, in the merge's fusion
        o = unrotate_rows(o, o_signs)
    return o.reshape(B, Hq, D).astype(out_dtype), lse.reshape(B, Hq)


def kivi_decode(
    q,
    k_codes,
    k_scale,
    k_min,
    v_codes,
    v_scale,
    v_min,
    num_tokens,
    layer,
    *,
    key_bits: int,
    value_bits: int,
    group_size: int,
    sm_scale: float,
    tuning: TuningConfig | None = None,
    interpret=False,
    low_precision: bool = False,
    windows=None,
    max_len: int = 0,
    skip: int = 0,
    sinks=None,
    out_dtype=jnp.float32,
    q_signs=None,
    o_signs=None,
):
    """Decode attention of one query token per row over the quantized KIVI cache of one layer.

    q: [B, Hq, D] bf16/fp16. Cache arrays as docs/layout.md with the leading L axis:
    k_codes [L,B,Hkv,Tq/Pk,D] u8, k_scale/k_min [L,B,Hkv,Tq/G,D] f16, v_codes u8 as rows
    [L,B,Hkv,D,Tq/Pv] or in blocks of 64 byte columns [L,B,Hkv,Tq/(64 Pv),D,64] (the cache
    blocks them at 2 bits, where the kernel is faster over blocks, and keeps rows at 4; either
    form gives the same bits), v_scale/v_min [L,B,Hkv,D/G,Tq] f16. num_tokens [B] int32: attend
    to positions [0, num_tokens[b]) (clamped to Tq) of layer `layer` (int32 scalar, may be
    traced; a traced layer outside [0, L) reads the nearest layer and gives o = NaN, inside
    the launch: `kivi_jax.cache.check_layer`'s policy with no launch of its own). Returns
    (o [B,Hq,D] normalized, in `out_dtype` (float32, bfloat16 or float16), lse [B,Hq] f32
    natural-log sum-exp of the scaled logits); rows with num_tokens == 0 give o = 0 and
    lse = -inf. o is computed in float32 and rounded to out_dtype once; where the
    launch merges its splits and attends everything itself, the kernel writes it so (one
    launch and nothing after it), else the merge after the launch does.

    `interpret`: False for the GPU; True or a `plgpu.InterpretGPUParams` runs the kernel under
    the Mosaic GPU interpreter (any backend). `low_precision`: the fp8 value product
    (`TuningConfig.fp8_values`; it applies at G = D and changes nothing elsewhere) on `tuning`
    or on choose_tuning's, the key product staying exact.
    `windows`: (k_window [L,B,Hkv,W,D], v_window [L,B,Hkv,D,W]), the cache's residual windows
    (bf16 or fp16, W a multiple of 64, token p of a row in slot p % W): the kernel then attends
    the whole row, num_tokens[b] being its length n: positions [0, n - W) from the codes and
    the min(n, W) filled slots of the windows, in one launch (docs/kernel.md); `max_len` > 0
    caps n (the cache's capacity: an overflowed row attends its first max_len tokens).
    `skip`: positions [0, skip) are not attended from the codes (a cache's sinks).
    `sinks`: (k_sink [L,B,Hkv,N,D], v_sink [L,B,Hkv,N,D]): the first N positions in full
    precision, attended from these buffers where they lie below the positions read from the
    codes (n: num_tokens, or with windows the length less W), i.e. the first min(n, N) of them
    (the rest are in the windows); skip must be N. With the windows in the launch the kernel
    attends them as one more chunk of its window unit (N a multiple of 8 up to 64, the
    windows' dtype: `sinks_in_kernel`); otherwise they join the merge of the splits.
    `q_signs`: D signs (+-1) s of the rotation diag(s) H / sqrt(D) by which the cache's keys
    are stored (`pallas_kernels.rotation`): q is rotated by it first, in float32, and rounded
    once to each product's operand (fp16 for the codes', the windows' dtype for the windows'
    and the sinks' in the kernel), in the kernel's prologue where it runs one (so no launch
    before it does). None: q as given. `o_signs`: the same for the values' rotation: o is
    rotated back by R^T (the model's basis) in float32 before its rounding to out_dtype, by
    the kernel where it writes the final rows, else in the merge after the launch.
    Raises ValueError on bad shapes/dtypes or a tuning that does not fit, NotImplementedError
    on unsupported bits, group sizes, head dims or dtypes, or where the windows do not fit the
    shared memory beside the default tuning's pipelines.
    """
    _, B, Hq, Hkv, D, Tq = check_inputs(
        q,
        k_codes,
        k_scale,
        k_min,
        v_codes,
        v_scale,
        v_min,
        num_tokens,
        layer,
        key_bits,
        value_bits,
        group_size,
    )
    out_dtype = check_out_dtype(out_dtype)
    if interpret is True:
        interpret = plgpu.InterpretGPUParams()
    elif interpret is None:
        interpret = False
    W = 0 if windows is None else check_windows(windows, k_codes.shape[0], B, Hkv, D)
    skip = _check_skip(skip)
    if sinks is not None:
        check_sinks(sinks, k_codes.shape[0], B, Hkv, D, skip)
    q_signs, o_signs = check_signs(q_signs, D), check_signs(o_signs, D)
    if tuning is None:
        tuning, taken = call_tuning(
            B,
            Hkv,
            Tq,
            key_bits=key_bits,
            value_bits=value_bits,
            group_size=group_size,
            head_dim=D,
            fp8_values=low_precision,
            q_heads=Hq // Hkv,
            window=W,
        )
        if W and not taken:
            raise NotImplementedError(
                f"the {W}-slot windows do not fit beside {tuning}'s pipelines (shared memory, "
                "or blocks per SM of a long launch)"
            )
    elif low_precision:
        tuning = dataclasses.replace(tuning, fp8_values=True)
    smem = launch_smem(key_bits, value_bits, group_size, D, Hq // Hkv)(tuning, window=W)
    if smem > SMEM_LIMIT:
        raise ValueError(
            f"tuning={tuning} needs about {smem} bytes of shared memory "
            f"(limit {SMEM_LIMIT}): fewer stages or warpgroups per block"
        )
    return _kivi_decode(
        q,
        (k_codes, k_scale, k_min, v_codes, v_scale, v_min),
        num_tokens,
        layer,
        None if windows is None else tuple(windows),
        None if sinks is None else tuple(sinks),
        max_len=int(max_len),
        skip=skip,
        key_bits=key_bits,
        value_bits=value_bits,
        group_size=group_size,
        sm_scale=float(sm_scale),
        tuning=tuning,
        interpret=interpret,
        out_dtype=out_dtype.name,
        q_signs=q_signs,
        o_signs=o_signs,
    )
