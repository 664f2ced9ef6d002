"""Sandbox launcher: the trusted half of `megarl.rewards.sandbox`, run as its own process.

    python -I -S -B _sandbox_exec.py '<json spec>'

It runs in a fresh single-threaded interpreter (so fork() and privilege changes are safe even
when the caller has threads), uses the standard library only, and never imports megarl.

Modes (spec["mode"]):
- "namespace": a child unshares user+mount+net+pid+ipc+uts namespaces; the launcher writes
  its uid/gid maps (inner uid -> spec["uid"] when the caller is root, else the caller's own
  uid). pid 1 of the new pid namespace builds a new read-only root from an empty skeleton
  directory (read-only binds of the interpreter and system libraries, size-limited tmpfs work
  dir and /tmp, /dev/{null,zero,random,urandom}, no /proc, no /etc beyond ld.so.cache),
  pivot_roots into it, and forks the program as pid 2, which switches to the inner uid, copies
  the input files into the work dir, and execs the program (losing all capabilities) under
  rlimits + seccomp.
- "rlimit": the fallback: drop to spec["uid"] if given, rlimits + seccomp, exec in the work
  dir. No filesystem isolation.
- "kill": drop to spec["uid"] and SIGKILL every process of that uid (fallback cleanup).

Exit status is mirrored: the caller sees the untrusted program's exit code, or the signal
that killed it. Launcher failures exit with code 125 and a "[sandbox-launcher]" line on stderr.
"""

import ctypes
import json
import os
import resource
import signal
import struct
import sys

LAUNCHER_FAILED = 125

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
CLONE_NEWCGROUP = 0x02000000
NS_FLAGS = (CLONE_NEWNS | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWUSER | CLONE_NEWPID
            | CLONE_NEWNET | CLONE_NEWCGROUP)
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MS_NOATIME, MS_NODIRATIME, MS_RELATIME = 1024, 2048, 1 << 21
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP = 1, 38, 22
SECCOMP_MODE_FILTER = 2
AF_UNIX = 1
EPERM, EACCES, ENOSYS = 1, 13, 38
_DEV_NODES = ("null", "zero", "random", "urandom")

# Syscalls the untrusted program never needs; numbers from the kernel's uapi headers.
_DENY = ("ptrace mount umount2 pivot_root chroot unshare setns keyctl add_key request_key bpf "
         "perf_event_open userfaultfd io_uring_setup io_uring_enter io_uring_register kexec_load "
         "kexec_file_load init_module finit_module delete_module reboot swapon swapoff acct "
         "process_vm_readv process_vm_writev personality open_by_handle_at name_to_handle_at "
         "fsopen fsconfig fsmount move_mount open_tree mount_setattr").split()
_SYSCALLS = {
    "x86_64": (0xC000003E, dict(zip(_DENY, (
        101, 165, 166, 155, 161, 272, 308, 250, 248, 249, 321, 298, 323, 425, 426, 427, 246,
        320, 175, 313, 176, 169, 167, 168, 163, 310, 311, 135, 304, 303, 430, 431, 432, 429,
        428, 442))) | {"clone": 56, "clone3": 435, "socket": 41}),
    "aarch64": (0xC00000B7, dict(zip(_DENY, (
        117, 40, 39, 41, 51, 97, 268, 219, 217, 218, 280, 241, 282, 425, 426, 427, 104, 294,
        105, 273, 106, 142, 224, 225, 89, 270, 271, 92, 265, 264, 430, 431, 432, 429, 428,
        442))) | {"clone": 220, "clone3": 435, "socket": 198}),
}

_libc = ctypes.CDLL(None, use_errno=True)


def _fail(msg: str) -> None:
    os.write(2, f"[sandbox-launcher] {msg}\n".encode())
    os._exit(LAUNCHER_FAILED)


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        _fail(f"{what}: {os.strerror(err)}")


def _mount(src, target, fstype, flags, data=None) -> None:
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    _check(_libc.mount(enc(src), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)),
           f"mount {src} -> {target}")


def _seccomp_filter(allow_unix_socket: bool) -> bytes | None:
    """A BPF program: deny `_DENY`, namespace-creating clone(), clone3 (ENOSYS, so libc falls
    back to clone), and socket() except AF_UNIX when allowed; kill on a foreign arch."""
    table = _SYSCALLS.get(os.uname().machine)
    if table is None:
        return None
    arch, nr = table
    ld_w, jeq, jset, jge, ret = 0x20, 0x15, 0x45, 0x35, 0x06
    allow, kill = 0x7FFF0000, 0x80000000
    errno = lambda e: 0x00050000 | e  # noqa: E731
    prog = [(ld_w, 0, 0, 4), (jeq, 1, 0, arch), (ret, 0, 0, kill), (ld_w, 0, 0, 0)]
    if arch == 0xC000003E:  # x32 ABI syscalls alias the 64-bit ones with bit 30 set
        prog += [(jge, 0, 1, 0x40000000), (ret, 0, 0, kill)]
    for name in _DENY:
        prog += [(jeq, 0, 1, nr[name]), (ret, 0, 0, errno(EPERM))]
    prog += [(jeq, 0, 1, nr["clone3"]), (ret, 0, 0, errno(ENOSYS))]
    prog += [(jeq, 0, 4, nr["clone"]), (ld_w, 0, 0, 16), (jset, 1, 0, NS_FLAGS),
             (ret, 0, 0, allow), (ret, 0, 0, errno(EPERM))]
    unix_ok = AF_UNIX if allow_unix_socket else 0xFFFFFFFF
    prog += [(jeq, 0, 4, nr["socket"]), (ld_w, 0, 0, 16), (jeq, 0, 1, unix_ok),
             (ret, 0, 0, allow), (ret, 0, 0, errno(EACCES))]
    prog += [(ret, 0, 0, allow)]
    return b"".join(struct.pack("HBBI", *ins) for ins in prog)


def _install_seccomp(allow_unix_socket: bool) -> None:
    _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    code = _seccomp_filter(allow_unix_socket)
    if code is None:
        return
    buf = ctypes.create_string_buffer(code, len(code))

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    prog = SockFprog(len(code) // 8, ctypes.addressof(buf))
    _check(_libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0), "seccomp")


def _set_rlimits(spec: dict, nproc_base: int = 0) -> None:
    mb = 1024 * 1024
    cpu = int(spec["cpu_s"])
    limits = [
        (resource.RLIMIT_CPU, (cpu, cpu + 1)),
        (resource.RLIMIT_AS, (spec["memory_mb"] * mb,) * 2),
        (resource.RLIMIT_FSIZE, (spec["fsize_mb"] * mb,) * 2),
        (resource.RLIMIT_NOFILE, (spec["nofile"],) * 2),
        (resource.RLIMIT_NPROC, (nproc_base + spec["nproc"],) * 2),
        (resource.RLIMIT_CORE, (0, 0)),
        (resource.RLIMIT_MEMLOCK, (0, 0)),
    ]
    for which, value in limits:
        resource.setrlimit(which, value)


def _drop_privileges(uid: int | None) -> None:
    if uid is None:
        return
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)


def _exec_untrusted(spec: dict, nproc_base: int, allow_unix_socket: bool) -> None:
    try:
        os.chdir(spec["cwd"])
        _set_rlimits(spec, nproc_base)
        _install_seccomp(allow_unix_socket)
        os.execve(spec["argv"][0], spec["argv"], spec["env"])
    except OSError as e:
        _fail(f"exec: {e}")


def _uid_task_count(uid: int) -> int:
    """Tasks (threads count) the uid already owns; RLIMIT_NPROC counts them all."""
    total = 0
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                if os.stat(f"/proc/{pid}").st_uid == uid:
                    total += len(os.listdir(f"/proc/{pid}/task"))
            except OSError:
                continue
    return total


def _mirror_exit(status: int) -> None:
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        signal.signal(sig, signal.SIG_DFL)
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        os.kill(os.getpid(), sig)
        os._exit(128 + sig)
    os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else LAUNCHER_FAILED)


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _make_skeleton(spec: dict) -> None:
    """Mount points of the new root, created before unsharing: inside the user namespace a
    root caller's uid is unmapped and could not create files."""
    root = spec["rootdir"]
    for path in spec["ro_binds"]:
        if os.path.isdir(path):
            os.makedirs(root + path, mode=0o755, exist_ok=True)
        else:
            os.makedirs(os.path.dirname(root + path), mode=0o755, exist_ok=True)
            open(root + path, "w").close()
    for link, dest in spec["symlinks"].items():
        os.symlink(dest, root + link)
    os.makedirs(root + "/dev", mode=0o755)
    for node in _DEV_NODES:
        open(f"{root}/dev/{node}", "w").close()
    for d in ("/tmp", spec["cwd"], "/.input", "/.old"):
        os.makedirs(root + d, mode=0o755)


def _copy_tree(src: str, dst: str) -> None:
    for name in os.listdir(src):
        s, d = os.path.join(src, name), os.path.join(dst, name)
        if os.path.isdir(s) and not os.path.islink(s):
            os.mkdir(d, 0o755)
            _copy_tree(s, d)
        elif os.path.isfile(s) and not os.path.islink(s):
            with open(s, "rb") as fin, open(d, "wb") as fout:
                fout.write(fin.read())


def _restrict(target: str, extra: int) -> None:
    """Remounts a bind mount nosuid, nodev (+ extra). Flags the source mount already has
    (noexec, atime mode) are kept: inside a user namespace they are locked and clearing one
    fails with EPERM."""
    keep = os.statvfs(target).f_flag & (MS_NOEXEC | MS_NOATIME | MS_NODIRATIME | MS_RELATIME)
    _mount(None, target, None, MS_BIND | MS_REMOUNT | MS_NOSUID | MS_NODEV | keep | extra)


def _build_root(spec: dict) -> None:
    root = spec["rootdir"]
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    _mount(root, root, None, MS_BIND)  # pivot_root needs the new root to be a mount point
    for path in spec["ro_binds"]:
        _mount(path, root + path, None, MS_BIND | MS_REC)
        _restrict(root + path, MS_RDONLY)
    for node in _DEV_NODES:
        _mount(f"/dev/{node}", f"{root}/dev/{node}", None, MS_BIND)
    # The work dir and /tmp are size-limited tmpfs (a full disk is not the program's to cause);
    # the host work dir is bound read-only at /.input, and pid 2 copies it in (as the inner
    # uid: pid 1's uid is unmapped and cannot create files on a tmpfs mounted here).
    size, inner = f"size={spec['tmpfs_mb']}m,nr_inodes=4096", spec["inner_uid"]
    _mount("tmpfs", root + "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, f"{size},mode=1777")
    _mount("tmpfs", root + spec["cwd"], "tmpfs", MS_NOSUID | MS_NODEV,
           f"{size},mode=0700,uid={inner},gid={inner}")
    _mount(spec["workdir"], root + "/.input", None, MS_BIND)
    _restrict(root + "/.input", MS_RDONLY)
    _check(_libc.syscall(155 if os.uname().machine == "x86_64" else 41,
                         root.encode(), (root + "/.old").encode()), "pivot_root")
    os.chdir("/")
    _check(_libc.umount2(b"/.old", MNT_DETACH), "umount old root")
    try:
        os.rmdir("/.old")
    except OSError:
        pass
    _restrict("/", MS_RDONLY)
    _libc.sethostname(b"sandbox", 7)


def _run_namespace(spec: dict) -> None:
    """launcher -> unsharer (new namespaces; the launcher writes its id maps, which a root
    launcher may point at any uid) -> pid 1 (builds the root, reaps) -> pid 2 (the program,
    as the inner uid, which maps to spec["uid"] or to the caller's own uid)."""
    outer_uid = spec["uid"] if spec.get("uid") is not None else os.getuid()
    outer_gid = spec["uid"] if spec.get("uid") is not None else os.getgid()
    if os.geteuid() == 0:
        os.setgroups([])  # no supplementary groups (e.g. root's) survive into the sandbox
    _make_skeleton(spec)
    ready_r, ready_w = os.pipe()
    go_r, go_w = os.pipe()
    status_r, status_w = os.pipe()
    unsharer = os.fork()
    if unsharer:
        for fd in (ready_w, go_r, status_w):
            os.close(fd)
        if os.read(ready_r, 1) == b"1":
            inner = spec["inner_uid"]
            _write(f"/proc/{unsharer}/setgroups", "deny")
            _write(f"/proc/{unsharer}/uid_map", f"{inner} {outer_uid} 1")
            _write(f"/proc/{unsharer}/gid_map", f"{inner} {outer_gid} 1")
            os.write(go_w, b"1")
        reported = os.read(status_r, 4)
        _, status = os.waitpid(unsharer, 0)
        _mirror_exit(struct.unpack("i", reported)[0] if len(reported) == 4 else status)
    for fd in (ready_r, go_w, status_r):
        os.close(fd)
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    _check(_libc.unshare(CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID
                         | CLONE_NEWIPC | CLONE_NEWUTS), "unshare")
    os.write(ready_w, b"1")
    if os.read(go_r, 1) != b"1":
        _fail("id maps were not written")
    init = os.fork()
    if init:
        _, status = os.waitpid(init, 0)
        _mirror_exit(status)  # used by the launcher only when pid 1 reported nothing
    # pid 1 of the new pid namespace. A pid-namespace init ignores its own fatal signals, so it
    # reports the program's wait status through a pipe instead of mirroring it.
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    _build_root(spec)
    child = os.fork()
    if child == 0:
        inner = spec["inner_uid"]
        os.setresgid(inner, inner, inner)
        os.setresuid(inner, inner, inner)  # non-zero uid: exec drops every capability
        _copy_tree("/.input", spec["cwd"])
        _check(_libc.umount2(b"/.input", MNT_DETACH), "umount /.input")
        # RLIMIT_NPROC counts the uid's tasks in this namespace: pid 1 shares the program's
        # uid unless a root caller mapped the program to a private uid.
        base = 0 if spec.get("uid") is not None else 1
        _exec_untrusted(spec, nproc_base=base, allow_unix_socket=True)
    while True:  # reap orphans until the program itself exits; its exit ends the namespace
        pid, status = os.waitpid(-1, 0)
        if pid == child:
            os.write(status_w, struct.pack("i", status))
            os._exit(0)


def _die_with_parent(parent: int) -> None:
    """SIGKILL this process when the caller dies (a killed trainer leaves no sandbox behind)."""
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:
        _fail("the caller exited")


def _run_rlimit(spec: dict) -> None:
    uid = spec.get("uid")
    _drop_privileges(uid)
    _die_with_parent(spec["parent"])  # a uid change cleared the parent-death signal
    base = 0 if uid is not None else _uid_task_count(os.getuid())
    _exec_untrusted(spec, nproc_base=base, allow_unix_socket=False)


def _kill_uid(spec: dict) -> None:
    _drop_privileges(spec["uid"])
    try:
        os.kill(-1, signal.SIGKILL)  # every process this uid may signal: its own, nothing else
    except ProcessLookupError:
        pass
    os._exit(0)


def main() -> None:
    try:
        spec = json.loads(sys.argv[1])
        if "parent" in spec:
            _die_with_parent(spec["parent"])
        {"namespace": _run_namespace, "rlimit": _run_rlimit, "kill": _kill_uid}[spec["mode"]](spec)
    except SystemExit:
        raise
    except BaseException as e:  # noqa: BLE001 - any launcher failure is reported, not raised
        _fail(f"{type(e).__name__}: {e}")


if __name__ == "__main__":
    main()
