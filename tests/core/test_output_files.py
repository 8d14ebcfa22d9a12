"""`moehal.cli.common.replace_file`, the one writer of `moehal bench --out`, conformance
`--report` and the tuners' tables: a new file beside the target, renamed over it (security
review, finding 1: a fixed `<out>.part` name followed a planted link)."""

from __future__ import annotations

import os
import stat

import pytest
from moehal.cli.common import replace_file


def _mode(path):
    return stat.S_IMODE(os.lstat(path).st_mode)


@pytest.fixture
def umask_027():
    old = os.umask(0o027)
    try:
        yield
    finally:
        os.umask(old)


def test_a_link_planted_at_the_old_part_name_is_neither_followed_nor_touched(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("the victim's data\n")
    out = tmp_path / "out.json"
    planted = tmp_path / "out.json.part"
    planted.symlink_to(victim)
    replace_file(out, lambda part: part.write_text("{}\n"))
    assert victim.read_text() == "the victim's data\n"
    assert planted.is_symlink() and os.readlink(planted) == str(victim)
    assert not out.is_symlink() and out.read_text() == "{}\n"


def test_an_existing_files_mode_is_kept(tmp_path, umask_027):
    out = tmp_path / "report.json"
    out.write_text("old\n")
    out.chmod(0o600)
    replace_file(out, lambda part: part.write_text("new\n"))
    assert out.read_text() == "new\n" and _mode(out) == 0o600
    out.chmod(0o664)  # wider than the umask allows a new file: still kept
    replace_file(out, lambda part: part.write_text("newer\n"))
    assert _mode(out) == 0o664


def test_a_new_file_gets_the_umasks_mode_not_mkstemps_0600(tmp_path, umask_027):
    out = tmp_path / "new.json"
    replace_file(out, lambda part: part.write_text("{}\n"))
    assert _mode(out) == 0o640


def test_a_failure_mid_write_keeps_the_old_file_and_leaves_no_part_file(tmp_path):
    out = tmp_path / "out.json"
    out.write_text("the old table\n")
    seen = []

    def fail(part):
        seen.append(part)
        part.write_text("half a tab")
        raise OSError(28, "No space left on device", str(part))

    with pytest.raises(OSError, match="No space left"):
        replace_file(out, fail)
    assert out.read_text() == "the old table\n"
    assert [p.name for p in tmp_path.iterdir()] == ["out.json"]
    (part,) = seen
    assert part.parent == tmp_path and part.name.startswith(".out.json.") and part.name.endswith(".part")


def test_two_runs_with_one_output_do_not_delete_each_others_part_file(tmp_path):
    """Both wrote `<out>.part`: the first to finish removed the other's file mid-write, whose
    rename then failed."""
    out = tmp_path / "out.json"

    def first(part):
        part.write_text("first\n")
        replace_file(out, lambda other: other.write_text("second\n"))  # another run, meanwhile

    replace_file(out, first)
    assert out.read_text() == "first\n"
    assert [p.name for p in tmp_path.iterdir()] == ["out.json"]


def test_a_part_file_swapped_for_a_link_while_written_is_not_renamed_into_place(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("the victim's data\n")
    out = tmp_path / "out.json"
    out.write_text("old\n")

    def swapped(part):
        part.write_text("{}\n")
        part.rename(tmp_path / "moved")
        part.symlink_to(victim)

    with pytest.raises(OSError, match="replaced while it was written"):
        replace_file(out, swapped)
    assert out.read_text() == "old\n" and not out.is_symlink()
    assert victim.read_text() == "the victim's data\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["moved", "out.json", "victim.txt"]
