"""bench/sass_static.py: the main loop's opcode mix from nvdisasm text (no GPU or CUDA needed)."""

import collections

from bench import sass_static

SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_1:
        /*0010*/                   LDS.128 R4, [R2] ;
.L_x_2:
        /*0020*/                   HMMA.16816.F32 R8, R4, R6, R8 ;
        /*0030*/               @P0 BRA `(.L_x_2) ;
        /*0040*/                   LOP3.LUT R5, R5, 0x3030303, RZ, 0xc0, !PT ;
        /*0050*/              @!P1 LOP3.LUT R6, R6, 0xc0c0c0c, RZ, 0xc0, !PT ;
        /*0060*/                   BRA `(.L_x_1) ;
        /*0070*/                   EXIT ;
.L_x_3:
        /*0080*/                   BRA `(.L_x_3) ;
"""


def test_largest_loop_with_nested_loops_and_predicates():
    mix, lo, hi = sass_static.main_loop_mix(SASS)
    assert (lo, hi) == (1, 6)  # .L_x_1 .. its backward branch; MOV and EXIT outside
    assert mix == {"LDS": 1, "HMMA": 1, "BRA": 2, "LOP3": 2}


def test_no_loop():
    mix, lo, hi = sass_static.main_loop_mix("        /*0000*/                   EXIT ;\n")
    assert not mix and (lo, hi) == (0, -1)


def test_step_loop_is_the_smallest_with_every_mma():
    """loop="step": the inner loop (.L_x_2 .. its branch) holds the one HMMA, as the outer does,
    and is the smaller; a loop without HMMA (.L_x_3) is never taken."""
    mix, lo, hi = sass_static.main_loop_mix(SASS, "step")
    assert (lo, hi) == (2, 3)
    assert mix == {"HMMA": 1, "BRA": 1}
    assert sass_static.main_loop_mix("        /*0000*/  EXIT ;\n", "step")[1:] == (0, -1)


def test_table_orders_opcodes_by_their_largest_count_and_sums_all():
    a = collections.Counter(HMMA=4, LOP3=9, BRA=1)
    b = collections.Counter(HMMA=12, LDS=2)
    table = sass_static.mix_table([a, b], ["a", "b"], top=2).splitlines()
    assert table[0] == "| opcode | a | b |"
    assert table[2:] == ["| HMMA | 4 | 12 |", "| LOP3 | 9 | 0 |", "| all | 14 | 14 |"]


def test_column_labels_are_file_stems_unless_they_repeat():
    assert sass_static.labels(["/t/2_2_128_default.ptx", "/t/4_4_32_default.ptx"]) == [
        "2_2_128_default",
        "4_4_32_default",
    ]
    assert sass_static.labels(["/a/kernel.ptx", "/b/kernel.ptx"]) == ["a/kernel", "b/kernel"]
