"""Launch configuration of the KIVI decode kernel: `TuningConfig`, `choose_tuning`, and `Plan`,
the static decisions a launch derives from its tuning, shape and target.

A `TuningConfig` holds the launch sizes and the per-shape features; `choose_tuning` picks them
for a shape on an H200 (docs/kernel.md says what each feature does and what it is worth).
`Plan` turns (tuning, shape, interpret) into the booleans the kernel body branches on, so that
every rule of the form "this feature applies only with that one" lives here, once.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from pallas_kernels.sm90.epilogue import MAX_CLUSTER, fold_channel
from pallas_kernels.sm90.layout import CACHE_BLOCK, PLANE, RESCALE_SLACK, WSM_MIN_STEPS
from pallas_kernels.sm90.reduce import reduction_scratch

SUPPORTED_BITS = (2, 4)
SUPPORTED_GROUPS = (32, 64, 128)
SUPPORTED_HEAD_DIMS = (64, 128)
MAX_PADDED_HEADS = 256  # mma.sync / wgmma N limit
SMEM_LIMIT = 223 * 1024  # H200: 227 KiB per block, less a margin for Mosaic's own scratch
LONG_UNIT_STEPS = 64  # steps per split from which a unit is throughput-bound (`windows_fit`)
# What the XLA merge of a launch's splits (two fusions after the kernel) costs, in pipeline
# steps of a one-row launch (`merged_splits`): at B = 1 a launch of 8 splits merged in its
# cluster was as fast as 33 merged by XLA at 5 steps per split (T = 8k), faster at 2-3 and
# slower at 9.
XLA_MERGE_STEPS = 4
STEP_TOKENS = CACHE_BLOCK  # tokens per pipeline step: one block of the cache order
BIAS_ROWS = 16  # key groups per dense_bias block: mma.sync's M


@dataclasses.dataclass(frozen=True)
class TuningConfig:
    """Static launch parameters of `kivi_decode` (docs/kernel.md describes each feature).

    Launch sizes:
      num_splits: thread blocks (or warpgroups) per (b, h) along the token axis
        (flash-decoding); each takes ceil(steps / num_splits) steps of 256 tokens.
      stages: TMA steps in flight per warpgroup.
      wg_per_block: warpgroups per thread block (1-4), each streaming its own (b, h, split)
        with its own pipeline; with W > 1 ptxas caps registers at 65536 / (128 W), so an SM
        holds W warpgroups.
    Value product:
      fp8_values: the value product on fp8 wgmma at G = D (a user's choice: it costs
        precision, B carries 4 significant bits); the key product stays exact on mma.sync.
      fold_v_warp: at G < D with D/4 <= G, each warp folds the value scale of its own channel
        group into its B operand (subnormal code fields, 64-bit vector loads); also loads the
        key vectors 64 bits at a time.
    Softmax:
      warp_softmax: at G = D, each warp runs its own online softmax and value product over
        its key rows (no cross-warp exchange in the loop), merged once per split.
      lazy_max: in the shared softmax at G = D, the common step takes no cross-warp max: the
        barrier that hands P over votes whether a score passed the running max + slack.
    Packing (at most four query heads per kv head):
      pack_planes: two planes per score tile (columns 0-3 and 4-7 of mma's N = 8).
      pack_zeros: with pack_planes, the padding halves of both products' B stay zero (less
        energy at the power cap).
      dense_bias: the key bias q . z_g of 16 key groups per mma.sync from a block of
        minimums of its own.
    Copies:
      release_slots: a pipeline slot goes back to the copy warp through an mbarrier instead
        of a warpgroup barrier.
      spread_copies: a step's copies are dealt over the warpgroup's four warps.
    Epilogue:
      merge_splits: the splits of a row merged in the kernel over distributed shared memory
        (one cluster of S / W blocks per row, where W divides S and S / W <= 8).
      pdl: programmatic dependent launch (griddepcontrol.wait before the first global read).
      q_prologue: the query's scale, cast, contraction order and padding inside the kernel.
    """

    num_splits: int = 8
    stages: int = 2
    wg_per_block: int = 1
    fp8_values: bool = False
    fold_v_warp: bool = False
    warp_softmax: bool = True
    lazy_max: bool = False
    pack_planes: bool = False
    pack_zeros: bool = False
    dense_bias: bool = False
    release_slots: bool = False
    spread_copies: bool = False
    merge_splits: bool = False
    pdl: bool = False
    q_prologue: bool = False

    def __post_init__(self):
        if self.num_splits < 1:
            raise ValueError(f"num_splits must be >= 1, got {self.num_splits}")
        if not 1 <= self.stages <= 8:
            raise ValueError(f"stages must be in [1, 8], got {self.stages}")
        if not 1 <= self.wg_per_block <= 4:
            raise ValueError(f"wg_per_block must be in [1, 4], got {self.wg_per_block}")


def padded_heads(q_heads: int) -> int:
    """The query heads of a kv head as the kernel pads them (mma's N: multiples of 8)."""
    return max(8, -(-q_heads // 8) * 8)


@dataclasses.dataclass(frozen=True)
class Plan:
    """What one launch does: the tuning's features resolved against the shape and the target.

    Natively the kernel runs the inline Mosaic GPU fragments (byte-permuted code tiles, per-warp
    vectors, its own barriers); under the interpreter (`interpret`) it runs their jnp
    equivalents, the same function, and the features that exist only as inline code are off.
    """

    tuning: TuningConfig
    B: int  # batch rows
    Hkv: int  # kv heads
    nq: int  # query heads per kv head
    D: int  # head dim
    Tq: int  # quantized capacity (tokens)
    L: int  # layers
    key_bits: int
    value_bits: int
    G: int  # group size
    interpret: bool
    vblock: bool  # value codes stored in blocks of 64 byte columns (2-bit caches)
    # the residual windows attended in the kernel: W slots (0: none) in window_dtype, the
    # rows' lengths (num_tokens) capped at length_cap (the cache's max_len; 0: no cap)
    window: int = 0
    window_dtype: str = "bfloat16"
    length_cap: int = 0
    # the first `skip` positions of every row are not attended (a cache's sinks: exact in a
    # buffer of their own, their codes stand-ins)
    skip: int = 0
    # the sinks (N <= 64 of them) attended in the window unit as one more chunk of 64 slots
    # (0: none, or merged with the splits outside the kernel)
    sinks: int = 0
    # the dtype in which the kernel writes each row's final output [B, Hkv, nq, D] (natural
    # channel order) after merging its splits in the kernel, where nothing is merged after
    # it ('': the float32 outputs [.., D, NP] as the mma tiles hold them)
    out_dtype: str = ""
    # the signs s of the keys' rotation diag(s) H / sqrt(D) (`pallas_kernels.rotation`): q is
    # rotated by it before use, in the prologue where the kernel runs it (`q_in_kernel`), else
    # with the rest of q's preparation in XLA (None: q as given)
    q_signs: tuple[float, ...] | None = None
    # the signs of the values' rotation, where the kernel writes the final rows (`out_dtype`):
    # each row's output rotated back by R^T before it is written (`transpose_rows`; None:
    # as attended, or rotated back after the launch's merge in XLA)
    o_signs: tuple[float, ...] | None = None

    @property
    def NP(self) -> int:  # padded query heads (mma's N)
        return padded_heads(self.nq)

    @property
    def W(self) -> int:
        return self.tuning.wg_per_block

    @property
    def S(self) -> int:
        return self.tuning.num_splits

    @property
    def Pk(self) -> int:  # key codes per byte
        return 8 // self.key_bits

    @property
    def Pv(self) -> int:
        return 8 // self.value_bits

    @property
    def planes(self) -> int:  # 64-token planes per step
        return STEP_TOKENS // PLANE

    @property
    def mtiles(self) -> int:  # 64-channel tiles of the head dim
        return self.D // PLANE

    @property
    def total_steps(self) -> int:
        return self.Tq // STEP_TOKENS

    @property
    def steps_per_split(self) -> int:
        return -(-self.total_steps // self.S)

    @property
    def native(self) -> bool:
        return not self.interpret

    @property
    def window_buffers(self) -> int:
        """Chunk buffers of the window tail: one natively (refilled behind a warpgroup
        barrier); one per chunk under the interpreter, whose race detector reports a TMA
        refill after a warpgroup barrier as racing with the reads before it."""
        return 1 if self.native else max(1, self.window_chunks)

    @property
    def window_chunks(self) -> int:
        """The window unit's chunks of 64 slots: the windows', then the sinks' (`sinks`)."""
        return self.window // PLANE + (1 if self.sinks else 0)

    @property
    def f8v(self) -> bool:
        """The value product on fp8 wgmma (`fp8_values`, G = D); else on mma.sync."""
        return self.tuning.fp8_values and self.G == self.D

    @property
    def vsub(self) -> bool:
        """G = D on mma.sync: value code fields as fp16 subnormals, B = P * s_t per token."""
        return self.G == self.D and not self.f8v

    @property
    def lgmax(self) -> bool:
        """The softmax's running max is over logit + log2 s_t (the value scale in B)."""
        return self.G == self.D

    @property
    def no_auto_barriers(self) -> bool:
        """Compiled without Mosaic's auto barriers: every hand-over in the loop has its own
        barrier (natively, both products on mma.sync); the fp8 path's SMEM stores through refs
        rely on the auto barriers."""
        return self.native and not self.f8v

    @property
    def own_pipeline(self) -> bool:
        """The kernel's own TMA pipeline (one copy warp, shared barriers) instead of
        `plgpu.emit_pipeline`."""
        return self.W > 1 or self.no_auto_barriers

    @property
    def wsm(self) -> bool:
        """Per-warp softmax and value product (`warp_softmax`)."""
        return self.tuning.warp_softmax and self.vsub and self.native

    @property
    def fvw(self) -> bool:
        """The value scale folded per warp's channel group (`fold_v_warp`)."""
        return self.tuning.fold_v_warp and self.native and self.D // 4 <= self.G < self.D

    @property
    def pk(self) -> bool:
        """Two planes per score tile (`pack_planes`)."""
        return self.tuning.pack_planes and self.nq <= 4 and not self.f8v and not self.wsm

    @property
    def pz(self) -> bool:
        """The packed tiles' padding halves zero (`pack_zeros`)."""
        return self.pk and self.tuning.pack_zeros

    @property
    def pzv(self) -> bool:
        """P stored as one B tile per plane (pack_zeros without fold_v_warp)."""
        return self.pz and not self.fvw

    @property
    def tiles(self) -> int:  # score tiles per step
        return self.planes // 2 if self.pk else self.planes

    @property
    def lazy_max(self) -> bool:
        return self.tuning.lazy_max and self.no_auto_barriers and self.vsub and not self.wsm

    @property
    def slack(self) -> float:
        return RESCALE_SLACK if self.lazy_max else 0.0

    @property
    def dense_bias(self) -> bool:
        """The key bias from 16-group blocks (`dense_bias`): each block spans whole steps and
        ends inside the cache."""
        return (
            self.tuning.dense_bias
            and self.no_auto_barriers
            and not self.wsm
            and BIAS_ROWS * self.G % STEP_TOKENS == 0
            and self.Tq // self.G >= BIAS_ROWS
        )

    @property
    def cluster(self) -> int:
        return merge_cluster(self.tuning, self.interpret)

    @property
    def q_in_kernel(self) -> bool:
        return self.tuning.q_prologue and self.native

    @property
    def release(self) -> bool:
        return self.no_auto_barriers and self.tuning.release_slots

    @property
    def value_groups_of_warps(self) -> tuple[int, ...]:
        """fvw: the channel group of warp w's D/4 channels."""
        return tuple((self.D // 4) * w // self.G for w in range(4))


def merge_cluster(tuning: TuningConfig, interpret: bool) -> int:
    """Blocks per cluster of the in-kernel split merge (`merge_splits`): S / W where W divides
    S and at most `MAX_CLUSTER` blocks hold a row (one under the interpreter, which has no
    distributed shared memory); 0 where the XLA merge runs instead."""
    W, S = tuning.wg_per_block, tuning.num_splits
    if not tuning.merge_splits or S % W:
        return 0
    C = S // W
    return C if C <= (1 if interpret else MAX_CLUSTER) else 0


def value_channel_order(plan: Plan):
    """The channel of each output row of the kernel's partial outputs (None: the natural
    order): with fold_v_warp, row 64 m + 16 w + i of value tile m holds channel (D/4) w +
    16 m + i."""
    if not plan.fvw:
        return None
    return fold_channel(np.arange(plan.D), plan.D)


def window_smem_bytes(window: int, head_dim: int, padded_heads: int) -> int:
    """Shared memory of one unit's window tail (`_Unit.attend_window`), 16-bit: one chunk of
    64 slots of the key window [64, D] and of the value window [D, 64], q in the natural
    order [N, D] and P [64, N]."""
    if not window:
        return 0
    return 2 * (2 * PLANE * head_dim + padded_heads * head_dim + PLANE * padded_heads)


def smem_bytes(
    tuning: TuningConfig,
    *,
    key_bits: int,
    value_bits: int,
    group_size: int,
    head_dim: int = 128,
    padded_heads: int = 16,
    window: int = 0,
) -> int:
    """Shared memory of one thread block (pipeline buffers + P, q, output tiles, the window
    tail's buffers where the kernel attends `window` residual slots, and where it merges its
    splits the merged row in the caller's layout, counted at float32)."""
    TS, D, G = STEP_TOKENS, head_dim, group_size
    step = TS * D * (key_bits + value_bits) // 8 + 2 * 2 * (TS // G * D + D // G * TS)
    W = tuning.wg_per_block
    red = reduction_scratch(padded_heads) * 4  # per-warpgroup reduction scratch (f32)
    p_bytes = 1 if tuning.fp8_values and G == D else 2  # P^T (B of the value product)
    per_wg = tuning.stages * step + p_bytes * TS * padded_heads + 2 * padded_heads * D * 3 + red
    per_wg += window_smem_bytes(window, D, padded_heads)
    rows_out = 4 * padded_heads * D if tuning.merge_splits else 0  # the merged row, transposed
    if (
        tuning.dense_bias
        and G == D
        and not tuning.fp8_values
        and not tuning.warp_softmax
        or (tuning.dense_bias and G < D)
    ):
        # (where the kernel takes it: `Plan.dense_bias`) the minimums' block and the warps'
        # bias rows replace the minimums' pipeline buffers
        per_wg += BIAS_ROWS * (2 * D + 4 * 4 * padded_heads) - tuning.stages * 2 * (TS // G * D)
    return W * per_wg + rows_out + 4096


def launch_smem(key_bits: int, value_bits: int, group_size: int, head_dim: int, q_heads: int):
    """`smem_bytes` of a cache's launches: size(tuning, window=0) -> bytes per block."""
    return functools.partial(
        smem_bytes,
        key_bits=key_bits,
        value_bits=value_bits,
        group_size=group_size,
        head_dim=head_dim,
        padded_heads=padded_heads(q_heads),
    )


def units_per_sm(tuning: TuningConfig, smem: int) -> int:
    """Units (rows x splits) an SM runs at once: with several warpgroups per block one block
    per SM, a unit per warpgroup; with one, as many blocks as the shared memory allows, at
    most two (~200-250 registers per thread allow two blocks of 128 threads per SM)."""
    if tuning.wg_per_block > 1:
        return tuning.wg_per_block
    return max(1, min(2, (227 * 1024) // smem))


def windows_fit(tuning: TuningConfig, steps: int, window: int, size) -> bool:
    """Whether a launch of `tuning` over `steps` pipeline steps per row takes the window
    tail's buffers (`size(tuning, window=...)`: its shared memory). Where the buffers would
    halve the blocks per SM, only short units take them: a unit of a few dozen steps mostly
    waits on latency, which the second wave hides, and attending the windows outside the
    kernel costs launches; a long one (LONG_UNIT_STEPS or more per split, e.g. 4-bit B = 8,
    T = 128k) is throughput, and half the blocks per SM made it 7% slower than the windows
    outside."""
    smem = size(tuning, window=window)
    if smem > SMEM_LIMIT:
        return False
    halved = units_per_sm(tuning, smem) < units_per_sm(tuning, size(tuning))
    return not halved or -(-steps // tuning.num_splits) < LONG_UNIT_STEPS


def choose_tuning(
    batch: int,
    kv_heads: int,
    max_tokens: int,
    *,
    key_bits: int = 2,
    value_bits: int = 2,
    group_size: int = 128,
    head_dim: int = 128,
    num_sms: int = 132,
    stages: int = 2,
    wg_per_block: int | None = None,
    fp8_values: bool = False,
    q_heads: int = 8,
    window: int = 0,
) -> TuningConfig:
    """Launch parameters for (B, Hkv, Tq) on an H200 (132 SMs).

    Splits: the grid is B * Hkv * S units run in waves of num_sms * (units per SM); S
    minimizes waves * (steps per split + 2), the 2 standing for a unit's fixed cost (prologue,
    epilogue) in steps; near-ties go to more splits, whose blocks hide the last wave's tail.
    Warpgroups per block: 2-bit caches at B * Hkv * T >= 2^22 take four (G = 128) or three
    (G < 128, where four pipelines do not fit the shared memory); below that size and at
    4 bits one warpgroup per block is as fast or faster. The features follow what paid on the
    H200 per shape (docs/kernel.md). `stages` and `wg_per_block` override the defaults;
    `q_heads` (query heads per kv head) sizes P and the q / output tiles in shared memory.
    `window`: residual-window slots the kernel attends too: where their chunk buffers fit
    beside the launch chosen without them, the q prologue runs in the kernel (which reads the
    caller's q for them anyway), and a one-wave launch of one warpgroup per block merges its
    splits in the kernel; the launch sizes are chosen as without windows, except where that
    launch would leave its splits to XLA and fewer splits merged in the kernel cost less
    (`merged_splits`: at one row, T <= 8k).
    """
    if max_tokens % STEP_TOKENS:
        raise ValueError(f"max_tokens={max_tokens} is not a multiple of {STEP_TOKENS}")
    f8v = fp8_values and group_size == head_dim
    base = TuningConfig(num_splits=1, stages=stages, fp8_values=fp8_values)
    size = launch_smem(key_bits, value_bits, group_size, head_dim, q_heads)
    if wg_per_block is None:
        many = key_bits == 2 and batch * kv_heads * max_tokens >= 1 << 22
        fits = [
            w
            for w in ((4, 3) if group_size == 128 else (3,))
            if size(dataclasses.replace(base, wg_per_block=w)) <= SMEM_LIMIT
        ]
        wg_per_block = fits[0] if many and fits else 1
    base = dataclasses.replace(base, wg_per_block=wg_per_block)
    smem = size(base)
    if smem > SMEM_LIMIT:
        raise ValueError(
            f"wg_per_block={wg_per_block} with stages={stages} needs {smem} "
            f"bytes of shared memory (limit {SMEM_LIMIT}): fewer warpgroups or "
            "stages"
        )
    steps = max_tokens // STEP_TOKENS
    slots = num_sms * units_per_sm(base, smem)
    bh = batch * kv_heads
    costs = {S: -(-bh * S // slots) * (-(-steps // S) + 2) for S in range(1, min(steps, 64) + 1)}
    best = min(costs.values())
    S = max(S for S, c in costs.items() if c <= 1.02 * best)
    wsm = warp_softmax_pays(wg_per_block, steps, S)
    # Two planes per tile at 2 bits (4-bit launches keep the per-warp softmax, which excludes
    # it); the slots' mbarrier pays only with four warpgroups and unpacked planes; the copies
    # spread over the warps with three.
    pack = key_bits == value_bits == 2 and not f8v
    release = wg_per_block == 4 and not pack
    spread = wg_per_block == 3
    # The per-warp value fold at 2 bits with several channel groups per token (at 4 bits
    # mixed); zero padding where both products take it (G = D).
    fvw = key_bits == value_bits == 2 and group_size < head_dim
    pz = pack and group_size == head_dim
    out = dataclasses.replace(
        base,
        num_splits=S,
        warp_softmax=wsm,
        release_slots=release,
        spread_copies=spread,
        pack_planes=pack,
        fold_v_warp=fvw,
        pack_zeros=pz,
    )
    # The dense key bias and the lazy max with four warpgroups at 2-bit G = 128.
    dense = (
        pz
        and group_size == 128
        and wg_per_block == 4
        and size(dataclasses.replace(out, dense_bias=True)) <= SMEM_LIMIT
    )
    lazy = pz and wg_per_block == 4
    out = dataclasses.replace(out, dense_bias=dense, lazy_max=lazy)
    # The splits merged in the kernel, with PDL and the q prologue, where four warpgroups hold
    # a 2-bit G = 128 row in at most two blocks of one wave (with fewer warpgroups per block a
    # finished block waits for its row, and it was slower).
    C = merge_cluster(dataclasses.replace(out, merge_splits=True), False)
    fused = (
        key_bits == value_bits == 2
        and group_size == 128
        and wg_per_block == 4
        and 1 <= C <= 2
        and -(-bh * S // wg_per_block) <= num_sms
    )
    out = dataclasses.replace(out, merge_splits=fused, pdl=fused, q_prologue=fused)
    if window and windows_fit(out, steps, window, size):
        # With the windows in the kernel, a launch of one wave whose rows fit a cluster also
        # merges its splits there: then nothing but the output's transpose runs around it.
        one_wave = wg_per_block == 1 and bh * S <= num_sms and S <= MAX_CLUSTER
        capped = wg_per_block == 1 and not one_wave and merged_splits(bh, steps, costs[S], num_sms)
        if capped:
            fewer = dataclasses.replace(
                out, num_splits=capped, warp_softmax=warp_softmax_pays(1, steps, capped)
            )
            if windows_fit(fewer, steps, window, size):
                out, one_wave = fewer, True
        out = dataclasses.replace(
            out,
            q_prologue=True,
            merge_splits=fused or one_wave,
            pdl=fused or one_wave,
        )
    return out


def warp_softmax_pays(wg_per_block: int, steps: int, splits: int) -> bool:
    """The per-warp softmax repays its epilogue (the warps' merge) over many steps per split,
    and only with one warpgroup per block (with four, its accumulators exceed the register
    cap's room)."""
    return wg_per_block == 1 and -(-steps // splits) >= WSM_MIN_STEPS


def merged_splits(rows: int, steps: int, cost: float, num_sms: int) -> int:
    """MAX_CLUSTER splits for a launch of `rows` rows (B * Hkv) x `steps` steps that merges
    them in the kernel, where that beats `cost` (the chosen launch's waves x (steps per split
    + 2)) plus the XLA merge it needs (`XLA_MERGE_STEPS`); else 0. Only where the rows' full
    clusters keep to half the SMs (a cluster's blocks run in one GPC; at B = 2, 16 clusters of
    8 ran slower than the XLA merge at 4 bits): one row at Hkv = 8. Smaller clusters with
    longer splits were not timed."""
    if rows * MAX_CLUSTER > num_sms // 2:
        return 0
    return MAX_CLUSTER if -(-steps // MAX_CLUSTER) + 2 <= cost + XLA_MERGE_STEPS else 0


def call_tuning(
    batch: int,
    kv_heads: int,
    max_tokens: int,
    *,
    key_bits: int = 2,
    value_bits: int = 2,
    group_size: int = 128,
    head_dim: int = 128,
    q_heads: int = 8,
    window: int = 0,
    fp8_values: bool = False,
) -> tuple[TuningConfig, bool]:
    """(the launch, whether it attends the windows) of a `kivi_decode` call left to choose its
    tuning: `choose_tuning`'s with the `window` slots where they fit beside its pipelines
    (`windows_fit`), else its launch without them, the windows then attended outside the
    kernel (what `kivi_jax.decode_attention` does on a cache)."""
    kw = dict(
        key_bits=key_bits,
        value_bits=value_bits,
        group_size=group_size,
        head_dim=head_dim,
        q_heads=q_heads,
        fp8_values=fp8_values,
    )
    if window:
        tuning = choose_tuning(batch, kv_heads, max_tokens, window=window, **kw)
        size = launch_smem(key_bits, value_bits, group_size, head_dim, q_heads)
        if windows_fit(tuning, max_tokens // STEP_TOKENS, window, size):
            return tuning, True
    return choose_tuning(batch, kv_heads, max_tokens, **kw), False
