"""`simulate --sharing` measures the paged allocator's shared blocks: without -a paged it is refused."""
from __future__ import annotations

from clirun import one_line_error, pagelab


def test_sharing_without_the_paged_allocator_is_refused(tmp_path):
    line = one_line_error(pagelab("simulate", "--limit", "20", "-a", "contiguous-max", "--sharing",
                                  "--out", "r", cwd=tmp_path))
    assert "--sharing measures the blocks the paged allocator shares" in line and "add -a paged" in line
    assert list(tmp_path.iterdir()) == []


def test_sharing_with_the_paged_allocator_reports_the_saving(tmp_path):
    result = pagelab("simulate", "--limit", "20", "-a", "paged,contiguous-max", "--sharing", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "sharing saves" in result.stderr
