"""A loop-mounted ext4 image for the storage tests: O_DIRECT needs a filesystem that honours it
(tmpfs does not). Needs root, mkfs.ext4 (Debian e2fsprogs, in the Makefile's APT_PACKAGES) and
mount; a missing mkfs.ext4 is a failure, and only an OS that forbids the mount itself (no
loop devices, no CAP_SYS_ADMIN) is a skip, with the reason mount gave."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
from pathlib import Path

import pytest


@contextlib.contextmanager
def loop_ext4(workdir: Path, size_mb: int = 256):
    mkfs = shutil.which("mkfs.ext4") or "/usr/sbin/mkfs.ext4"
    if not Path(mkfs).exists():
        pytest.fail("mkfs.ext4 is missing: install e2fsprogs (the Makefile's APT_PACKAGES has it)")
    image, mnt = workdir / "ext4.img", workdir / "mnt"
    mnt.mkdir()
    with open(image, "wb") as f:
        f.truncate(size_mb << 20)
    subprocess.run([mkfs, "-q", "-F", str(image)], check=True, capture_output=True)
    res = subprocess.run(["mount", "-o", "loop", str(image), str(mnt)], capture_output=True, text=True)
    if res.returncode != 0:
        image.unlink()
        pytest.skip(f"the OS forbids a loop mount here (mount: {res.stderr.strip() or res.returncode})")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False, capture_output=True)
        image.unlink(missing_ok=True)
