"""bench/tail_probe.py: the figures of one launch from its units' stamps (no GPU needed)."""
import importlib.util
import pathlib
import sys

import numpy as np

_bench = pathlib.Path(__file__).parent.parent / "bench"
sys.path.insert(0, str(_bench))
_spec = importlib.util.spec_from_file_location("tail_probe", _bench / "tail_probe.py")
tail_probe = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tail_probe)


def _units(t0_us, t1_us, sm, origin):
    """Stamps as the kernel writes them: ns mod 2^24 around an arbitrary origin."""
    ns = lambda t: (origin + (np.asarray(t) * 1e3).astype(np.int64)) % tail_probe.WRAP
    return ns(t0_us), ns(t1_us), np.asarray(sm)


def test_launch_stats_unwraps_and_counts_idle():
    # two SMs: SM 0 busy 0..100 us (two units), SM 1 busy 2..50 us; the origin puts the
    # 24-bit wrap inside the launch
    t0, t1, sm = _units([0, 10, 2], [90, 100, 50], [0, 0, 1], tail_probe.WRAP - 30_000)
    r = tail_probe.launch_stats(t0, t1, sm)
    assert abs(r["span"] - 100) < 1e-6 and abs(r["starts"] - 10) < 1e-6
    assert abs(r["unit_max"] - 90) < 1e-6 and abs(r["unit_min"] - 48) < 1e-6
    # busy 100 + 48 of 2 x 100
    assert abs(r["idle"] - (1 - 148 / 200)) < 1e-9 and r["sms"] == 2
    assert abs(r["end_max"] - 100) < 1e-6


def test_rank_corr():
    a = np.array([1.0, 2.0, 3.0, 4.0])
    assert tail_probe.rank_corr(a, a * 10) == 1.0
    assert tail_probe.rank_corr(a, -a) == -1.0


def test_summarize_back_to_back_gaps_and_same_sm():
    # four launches on three SMs, each 100 us, 10 us apart; SM 1 always the slowest
    runs = []
    for i in range(4):
        o = i * 110.0
        runs.append(_units([o, o + 1, o], [o + 90, o + 100, o + 80], [0, 1, 2], 7))
    r = tail_probe.summarize(runs, True)
    assert abs(r["gap"] - 10) < 1e-6 and abs(r["span"] - 100) < 1e-6
    assert r["same_sm_slow"] == 1.0 and r["sms"] == 3
    assert "gap" not in tail_probe.summarize(runs, False)
