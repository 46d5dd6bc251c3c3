"""What a node's agent accepts as an upload (the tar the driver makes of a host path): names
under the upload only, nothing through a link of the archive, no hard link out, no device."""

from __future__ import annotations

import io
import tarfile

import pytest

from minisandbox.cluster.node import _checked
from minisandbox.errors import SandboxFileError


def member(
    name: str, kind: bytes = tarfile.REGTYPE, link: str = "", mode: int = 0o644
) -> tarfile.TarInfo:
    m = tarfile.TarInfo(name)
    m.type, m.linkname, m.mode = kind, link, mode
    return m


def test_what_the_driver_makes_is_accepted_with_set_id_bits_dropped() -> None:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        tar.addfile(member("up", tarfile.DIRTYPE, mode=0o755))
        tar.addfile(member("up/abs", tarfile.SYMTYPE, "/etc/passwd"))  # a link stays a link
        tar.addfile(member("up/tool", mode=0o4755), io.BytesIO(b""))
        tar.addfile(member("up/same", tarfile.LNKTYPE, "up/tool"))
    with tarfile.open(fileobj=io.BytesIO(buf.getvalue())) as tar:
        ok = _checked(tar.getmembers(), "up")
    assert [m.name for m in ok] == ["up", "up/abs", "up/tool", "up/same"]
    assert ok[2].mode == 0o755


@pytest.mark.parametrize(
    "bad",
    [
        [member("/etc/cron.d/x")],
        [member("up/../../x")],
        [member("other/x")],
        [member("up/l", tarfile.SYMTYPE, "/etc"), member("up/l/passwd")],
        [member("up/h", tarfile.LNKTYPE, "/etc/shadow")],
        [member("up/h", tarfile.LNKTYPE, "up/../../etc/shadow")],
        # A name twice: the second member would be written through the first, a symlink.
        [member("up/x", tarfile.SYMTYPE, "/etc/passwd"), member("up/x")],
        [member("up/x", tarfile.SYMTYPE, "/etc"), member("up/./x", tarfile.DIRTYPE)],
        # A hard link through a symlink of the archive, or to what is not an earlier file.
        [member("up/l", tarfile.SYMTYPE, "/etc"), member("up/h", tarfile.LNKTYPE, "up/l/passwd")],
        [member("up/h", tarfile.LNKTYPE, "up/later"), member("up/later")],
        [member("up/d", tarfile.DIRTYPE), member("up/h", tarfile.LNKTYPE, "up/d")],
        [member("up/dev", tarfile.CHRTYPE)],
        [member("up/fifo", tarfile.FIFOTYPE)],
    ],
)
def test_anything_else_is_refused(bad: list[tarfile.TarInfo]) -> None:
    with pytest.raises(SandboxFileError, match="upload"):
        _checked(bad, "up")
