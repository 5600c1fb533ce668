"""hyspec.files.write_whole, the writer behind Session.save and `hyspec bench --out`: the bytes
go to a temporary file beside the target, which then replaces it; a link stays a link, an
existing file keeps its mode, a new one gets the umask's."""

from __future__ import annotations

import os
import stat

from hyspec.files import write_whole


def test_a_link_stays_a_link_and_its_file_is_replaced(tmp_path):
    target, link = tmp_path / "target.json", tmp_path / "link.json"
    target.write_text("old")
    os.chmod(target, 0o640)
    link.symlink_to(target)
    write_whole(link, lambda f: f.write(b"new"))
    assert link.is_symlink() and target.read_text() == "new" and stat.S_IMODE(target.stat().st_mode) == 0o640
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.json", "target.json"]


def test_the_temporary_file_is_beside_the_target_and_a_new_file_gets_the_umasks_mode(tmp_path):
    """Beside it: moved over the target in one rename (a temporary file elsewhere, on another
    file system, could not be)."""
    seen = []
    old = os.umask(0o027)
    try:
        write_whole(tmp_path / "r.json", lambda f: seen.extend(p.name for p in tmp_path.iterdir()))
    finally:
        os.umask(old)
    assert len(seen) == 1 and seen[0].startswith(".r.json.") and seen[0].endswith(".tmp")
    assert stat.S_IMODE((tmp_path / "r.json").stat().st_mode) == 0o640
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]
