"""Run a command on which the kernel refuses pidfd_open(2), as a kernel older than 5.3
does (ENOSYS) or as a process out of file descriptors does (EMFILE).

    python no_pidfd.py ERRNO_NAME COMMAND [ARG...]

A seccomp filter (inherited by every descendant, kept across exec) makes pidfd_open fail
with that errno; every other system call is untouched. Exits 77 when the filter cannot
be installed (an unknown architecture, or seccomp unavailable).
"""

import ctypes
import errno
import os
import platform
import struct
import sys

PIDFD_OPEN = 434  # the same number on every architecture (the unified syscall table)
AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 38, 22, 2
LD_ABS_W, JEQ_K, RET_K = 0x20, 0x15, 0x06
RET_ALLOW, RET_ERRNO = 0x7FFF0000, 0x00050000


class SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def install(err: int) -> bool:
    arch = AUDIT_ARCH.get(platform.machine())
    if arch is None:
        return False
    prog = [
        (LD_ABS_W, 0, 0, 4),  # seccomp_data.arch
        (JEQ_K, 0, 3, arch),  # another ABI: allow
        (LD_ABS_W, 0, 0, 0),  # seccomp_data.nr
        (JEQ_K, 0, 1, PIDFD_OPEN),
        (RET_K, 0, 0, RET_ERRNO | err),
        (RET_K, 0, 0, RET_ALLOW),
    ]
    code = b"".join(struct.pack("HBBI", *ins) for ins in prog)
    buf = ctypes.create_string_buffer(code, len(code))
    fprog = SockFprog(len(prog), ctypes.cast(buf, ctypes.c_void_p))
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        return False
    return libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0) == 0


if __name__ == "__main__":
    err = getattr(errno, sys.argv[1])
    if not install(err):
        sys.exit(77)
    try:
        os.pidfd_open(os.getpid())
    except OSError as e:
        assert e.errno == err, e
    else:
        sys.exit(77)
    os.execvp(sys.argv[2], sys.argv[2:])
