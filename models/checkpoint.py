"""Checks shared by the GGUF and Hugging Face loaders, run once per conversion: every tensor of
the file used by the model (or explicitly allowed not to be), every tensor the right shape, every
value finite in the dtype it is loaded in.

The loaders raise their own ValueError subclass (GGUFError, CheckpointError); these helpers take
it as `error` so that messages keep one type per format.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterable, Sequence

import numpy as np

MAX_NAMED = 5  # tensor names quoted in one message; the count says how many more


def natural_key(name: str) -> list:
    """Sort key that puts layers.2 before layers.10."""
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def some_names(names: Sequence[str]) -> str:
    """The first MAX_NAMED names, and how many more."""
    shown = ", ".join(names[:MAX_NAMED])
    more = len(names) - MAX_NAMED
    return shown + (f" (and {more} more)" if more > 0 else "")


def check_names(
    source: str,
    available: Iterable[str],
    needed: Sequence[str],
    *,
    allow_unused: bool,
    config_hint: str,
    error: type[ValueError],
    stacklevel: int = 3,
) -> list[str]:
    """Raise `error` naming the tensors the model needs that `available` lacks, and (unless
    allow_unused) the ones it holds that the model does not use: a config that declares fewer
    layers than the weights would otherwise load a truncated model. With allow_unused, warn
    (UserWarning, attributed `stacklevel` frames up: the loader's caller) and return the unused
    names, naturally sorted."""
    have = set(available)
    missing = [n for n in needed if n not in have]
    if missing:
        raise error(
            f"{source}: {len(missing)} tensor(s) that {config_hint} needs are missing from the "
            f"checkpoint: {some_names(missing)}"
        )
    unused = sorted(have - set(needed), key=natural_key)
    if unused and not allow_unused:
        raise error(
            f"{source}: {len(unused)} tensor(s) in the checkpoint are not used by {config_hint}: "
            f"{some_names(unused)}; does the config match the weights? To load anyway, pass "
            "allow_unused=True (--allow-unused-weights on the command line)"
        )
    if unused:
        warnings.warn(
            f"{source}: ignoring {len(unused)} tensor(s) not used by {config_hint}: "
            f"{some_names(unused)}",
            stacklevel=stacklevel,
        )
    return unused


def check_shape(source: str, name: str, shape: tuple, want: tuple, error: type[ValueError]):
    if tuple(shape) != tuple(want):
        raise error(
            f"{source}: tensor {name} has shape {tuple(shape)}, the config implies {tuple(want)}"
        )


def to_dtype(
    a: np.ndarray, dtype: np.dtype, name: str, source: str, error: type[ValueError]
) -> np.ndarray:
    """`a` (float32) in `dtype`; raise `error` naming the tensor if any value is NaN or inf.

    A NaN weight makes every logit NaN and argmax picks token 0, so generation "succeeds" on
    garbage; the check costs one pass over the weights per conversion (~0.1 s per 100M values).
    Values finite in float32 but beyond the target's range (float16 tops out at 65504) are
    reported as an overflow, not as damage.
    """
    with np.errstate(over="ignore"):  # an overflow is reported below, by tensor name
        out = a.astype(dtype)
    bad = int(np.count_nonzero(~np.isfinite(out)))
    if bad:
        src_bad = int(np.count_nonzero(~np.isfinite(a)))
        if src_bad:
            nan = int(np.count_nonzero(np.isnan(a)))
            raise error(
                f"{source}: tensor {name} has {src_bad} non-finite value(s) ({nan} NaN, "
                f"{src_bad - nan} inf) of {a.size}; the file is damaged"
            )
        raise error(
            f"{source}: tensor {name}: {bad} value(s) of {a.size} overflow {np.dtype(dtype).name} "
            f"(largest |x| = {float(np.abs(a).max()):g}); load the model in float32 or bfloat16"
        )
    return out
