"""benchmarks/f64_online.py reads the shim's exit line on online tuning."""

import re
from pathlib import Path

from benchmarks.f64_online import online_summary

ROOT = Path(__file__).resolve().parents[2]


def test_the_summary_is_read_from_the_line_online_c_prints(tmp_path):
    source = (ROOT / "shim" / "src" / "online.c").read_text()
    printed = re.search(r'"online tuning: measured %lu kernels \(%lu candidates timed\) in %\.0f ms; '
                        r'%lu kernels from %s; ', source)
    assert printed, "online.c's summary format changed: update ONLINE_SUMMARY"
    log = tmp_path / "shim.log"
    log.write_text("mucudnn: info: something else\nmucudnn: summary: online tuning: measured 12 kernels "
                   "(340 candidates timed) in 5210 ms; 3 kernels from /x/H200-cudnn91900.plan; "
                   "0 passed through ()\n")
    assert online_summary(log) == {"measured_kernels": 12, "candidates_timed": 340,
                                   "measuring_ms": 5210, "kernels_from_file": 3}


def test_no_summary_is_an_empty_result(tmp_path):
    assert online_summary(tmp_path / "missing.log") == {}
    (tmp_path / "quiet.log").write_text("mucudnn: info: nothing\n")
    assert online_summary(tmp_path / "quiet.log") == {}
