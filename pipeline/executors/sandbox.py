"""The Linux sandbox every process that runs branch or harness code enters. Standard library only.

Branch code is written by a model rewarded for a higher number, so it must not reach the sealed
labels, the store, the cache, other runs' outputs, the user's home or the network. `enter(spec)`
is called in a freshly forked, single-threaded process (a warm worker's child, or `python -m/-c
child.py` for a one-off or a Ray stage), the `outer` process, which ends up as:

    parent (the warm worker, or a forked helper: writes the outer's uid/gid maps)
      └─ outer (new user, mount, pid, ipc, uts and, unless allowed, network namespace; waits)
           ├─ init (pid 1 of the new pid namespace: a spawned `cat` on a pipe the outer holds)
           └─ the stage (pid 2); `enter` returns only here

The outer process builds a new root on a tmpfs and the stage pivots into it (the outer with it):

- `/usr /bin /lib* /sbin /etc /opt` and the Python environment (prefixes, site-packages), read-only,
  with our own package and the lab's folder masked inside them;
- `spec["ro"]`: the stage's code view, `{data}`, upstream outputs (or, for a scorer, the predictions
  file and the seal), read-only, at their own paths so argv needs no rewriting; every mount of a
  read-only tree is checked read-only, or the stage does not start;
- `spec["rw"]`: read-write binds (only trusted `prepare` gets them: `{data}` and `{sealed}`);
- `spec["out"]`: a tmpfs of `out_max_mb` at the output path; when the stage has exited, the outer
  process copies the regular files and folders it holds into the real folder, up to `out_max_mb`
  of file sizes (never a symlink, hard link, device or fifo: each one skipped is said in the log).
  So `{out}` is bounded and the scorer only ever reads regular files the stage wrote;
- a private `/tmp` (tmpfs of `tmp_max_mb`) and `/dev/shm` (`shm_max_mb`, 64 MB: tmpfs is RAM no
  rlimit counts, see pipeline.memory.MemoryPlan), a minimal `/dev` (with `gpus`: the NVIDIA control nodes
  and only the stage's own `/dev/nvidia<N>`, see `gpu_plan`), a fresh `/proc`; for a stage of two
  GPUs or more, the PCI tree and the NUMA nodes of /sys read-only, where NCCL reads how its GPUs
  connect (`needs_sysfs`, `sysfs_paths`; not /sys/class's other views, DMI or the cgroups).

Nothing else exists inside: not the lab's `runs/` (seal, store, cache, worktrees, logs), not
`$HOME`. The stage then drops every capability, becomes an unprivileged uid (a fresh one per stage
when we run as root, else our own), sets `no_new_privs`, `RLIMIT_NPROC` and `RLIMIT_FSIZE` (which
also bounds its log). When it exits, the outer process kills init, and with it whatever is left in
the pid namespace: no process outlives its stage. A signal the stage dies of without the outer
process getting it too is reported as an exit (128 + n), the method's failure: only the machinery's
kill of the whole process group reads as infrastructure.
Setting up costs a few milliseconds in the forked child, so warm dispatch stays fast.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import re
import signal
import stat
import sys
import time
from typing import Any, NoReturn

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MS_NOATIME, MS_NODIRATIME, MS_RELATIME = 1024, 2048, 1 << 21
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS = 1, 24, 38
CAP_LAST = 63
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "arm64": 41}.get(platform.machine(), 155)
SYS_CAPSET = {"x86_64": 126, "aarch64": 91, "arm64": 91}.get(platform.machine(), 126)
LINUX_CAPABILITY_VERSION_3 = 0x20080522

SYSTEM_RO = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc", "/opt")
DEVICES = ("null", "zero", "full", "random", "urandom", "tty")
GPU_CONTROL_NODES = ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-modeset")  # no GPU's own
NVIDIA_PROC = "/proc/driver/nvidia/gpus"  # one folder per GPU, by PCI bus id: its minor and UUID
# a multi-GPU stage's view of the device tree (`needs_sysfs`): the PCI tree (each root complex under
# /sys/devices: every device on the bus, network and storage controllers too), the NUMA nodes; not
# /sys/class's other views, DMI, the cgroups
SYSFS = ("/sys/devices/system/node", "/sys/class/pci_bus", "/sys/bus/pci")
NEWROOT_CANDIDATES = ("/mnt", "/srv", "/media", "/boot", "/var/tmp", "/opt")
OWN_PACKAGES = ("pipeline", "agent")
MAX_OUT_FILES = 100_000
# as root, the stage whose sandbox process has pid p runs as kuid `stage_uid(p)` = base + p: live pids
# are distinct, so are live stages' uids (a pid modulo anything repeats where pid_max is large), and
# the base lies above every /etc/subuid and /etc/subgid range and every real user's id
UID_FLOOR = 1 << 30
PID_MAX_LIMIT = 1 << 22  # the kernel's largest pid_max (PID_MAX_LIMIT on 64-bit)
SUBID_FILES = ("/etc/subuid", "/etc/subgid")
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1
INIT = ("/bin/cat",) if os.path.exists("/bin/cat") else ("/usr/bin/cat",)  # pid 1: lives while we hold its stdin
STAGE_SIGNALS_AS_EXIT = {signal.SIGKILL, signal.SIGTERM, signal.SIGHUP, signal.SIGINT}  # see _wait_and_exit
SETUP_FAILED = 125  # exit code of a stage whose sandbox could not be set up (see the log)
OFF_HINT = 'set [run] sandbox = "off" in research.toml to run unsandboxed (README: "Sandbox")'

DEFAULTS: dict[str, Any] = {"ro": [], "rw": [], "out": None, "network": False, "out_max_mb": 4096,
                            "tmp_max_mb": 1024, "shm_max_mb": 64, "max_procs": 256}

_libc = ctypes.CDLL(None, use_errno=True)


def _check(ret: int, what: str) -> None:
    if ret != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"{what}: {os.strerror(e)}")


def _mount(src: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    enc = lambda s: s.encode() if s is not None else None  # noqa: E731
    _check(_libc.mount(enc(src), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)),
           f"mount {src or fstype} on {target}")


def _write(path: str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def _flags_of(path: str) -> int:
    """The mount flags a read-only remount must keep (locked ones cannot be dropped in a user ns)."""
    f = os.statvfs(path).f_flag
    out = 0
    for st_bit, ms_bit in ((os.ST_NOSUID, MS_NOSUID), (os.ST_NODEV, MS_NODEV), (os.ST_NOEXEC, MS_NOEXEC),
                           (os.ST_NOATIME, MS_NOATIME), (os.ST_NODIRATIME, MS_NODIRATIME),
                           (os.ST_RELATIME, MS_RELATIME)):
        if f & st_bit:
            out |= ms_bit
    return out


_OCTAL = re.compile(rb"\\([0-7]{3})")


def _submounts(target: str) -> list[str]:
    """Mount points at or below `target`. mountinfo is bytes with octal escapes (\\040 for a space);
    any other byte, UTF-8 included, is the path's own."""
    out = []
    prefix = target.rstrip("/") + "/"
    with open("/proc/self/mountinfo", "rb") as fh:
        for line in fh:
            point = os.fsdecode(_OCTAL.sub(lambda m: bytes([int(m.group(1), 8)]), line.split()[4]))
            if point == target or point.startswith(prefix):
                out.append(point)
    return out


def _bind(src: str, dst: str, *, readonly: bool) -> None:
    _mount(src, dst, None, MS_BIND | MS_REC)
    if not readonly:
        return
    points = _submounts(dst)
    if dst not in points:
        raise OSError(errno.ENOENT, f"bind of {src} not found in mountinfo")
    for point in points:  # fail closed: every mount of the tree read-only, or no sandbox
        if not os.statvfs(point).f_flag & os.ST_RDONLY:
            _mount(None, point, None, MS_REMOUNT | MS_BIND | MS_RDONLY | _flags_of(point))
        if not os.statvfs(point).f_flag & os.ST_RDONLY:
            raise OSError(errno.EPERM, f"{point} stayed writable")


def _makedirs_in(root: str, path: str, *, as_file: bool = False) -> str:
    """`root + path` created inside the new root (a file when the bind source is one)."""
    dst = root + path
    os.makedirs(os.path.dirname(dst) if as_file else dst, mode=0o755, exist_ok=True)
    if as_file and not os.path.exists(dst):
        os.close(os.open(dst, os.O_WRONLY | os.O_CREAT, 0o644))
    return dst


def python_paths() -> tuple[list[str], list[str]]:
    """The Python environment the stage needs read-only, real paths too: (prefixes, other import paths)."""
    def norm(ps: list[str]) -> list[str]:
        out = {q for p in ps if p and os.path.isabs(p) and os.path.exists(p)
               for q in (os.path.normpath(p), os.path.realpath(p))}
        return sorted(out)

    prefixes = norm([sys.prefix, sys.base_prefix, sys.exec_prefix, os.path.dirname(sys.executable)])
    return prefixes, [p for p in norm(sys.path) if p not in prefixes]


def _outside_system(path: str) -> bool:
    return not any(path == s or path.startswith(s + "/") for s in SYSTEM_RO)


def hidden_paths(spec: dict[str, Any]) -> list[str]:
    """What no stage may see: the spec's list (from the driver) and, wherever *this* process (a
    warm worker, a Ray node) finds them, our own packages: their harness code tells how labels are made."""
    import importlib.util

    found = []
    for name in OWN_PACKAGES:
        try:
            s = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            s = None
        for loc in (s.submodule_search_locations or []) if s is not None else []:
            found.append(loc)
    return sorted({os.path.realpath(p) for p in [*spec.get("hidden", []), *found]})


def _plan(spec: dict[str, Any]) -> tuple[list[str], list[tuple[str, str]]]:
    """(the Python environment's read-only folders, the stage's (path, mode) binds), outermost
    first; mode is 'ro', 'rw' or 'out'."""
    homes = {"/", "/root", "/home", os.path.realpath(os.path.expanduser("~"))}
    hidden = hidden_paths(spec)
    prefixes, imports = python_paths()
    env: list[str] = []
    for p in prefixes + imports:
        if p in homes:
            continue  # a whole home (or /): never mounted
        if p in imports and any(h == p or h.startswith(p.rstrip("/") + "/") for h in hidden):
            continue  # e.g. the source tree our package is imported from: its stages need none of it
        # (inside a prefix, what `hidden` names is masked instead: site-packages must stay)
        if _outside_system(p) and not any(p == q or p.startswith(q + "/") for q in env):
            env.append(p)
    stage: dict[str, str] = {}
    for mode in ("ro", "rw"):
        for p in spec.get(mode, []):
            stage[os.path.normpath(p)] = mode
    if spec.get("out"):
        stage[os.path.normpath(spec["out"])] = "out"
    by_depth = lambda p: (p.count("/"), p)  # noqa: E731
    return sorted(env, key=by_depth), sorted(stage.items(), key=lambda kv: by_depth(kv[0]))


def _newroot_mountpoint(paths: list[str]) -> str:
    for cand in NEWROOT_CANDIDATES:
        if os.path.isdir(cand) and not os.path.islink(cand) and not any(
                p == cand or p.startswith(cand + "/") for p in paths):
            return cand
    raise OSError(errno.ENOENT, f"no folder to build the sandbox root on (tried {NEWROOT_CANDIDATES})")


def _user_procs(uid: int) -> int:
    n = 0
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                if os.stat(f"/proc/{pid}").st_uid == uid:
                    n += 1
            except OSError:
                pass
    return n


def _drop_capabilities() -> None:
    for cap in range(CAP_LAST + 1):
        if _libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0 and ctypes.get_errno() == errno.EINVAL:
            break
    header = (ctypes.c_uint32 * 2)(LINUX_CAPABILITY_VERSION_3, 0)
    data = (ctypes.c_uint32 * 6)()
    _check(_libc.syscall(SYS_CAPSET, header, data), "capset")
    _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")


def nvidia_gpus(proc_dir: str = NVIDIA_PROC) -> list[dict[str, Any]]:
    """The driver's GPUs in PCI bus order (the order of nvidia-smi's and, on a machine of one GPU
    model, CUDA's indices): [{"bus", "minor", "uuid"}]; [] where the driver says nothing."""
    out = []
    try:
        names = sorted(os.listdir(proc_dir))
    except OSError:
        return []
    for bus in names:
        info: dict[str, Any] = {"bus": bus, "minor": None, "uuid": None}
        try:
            with open(os.path.join(proc_dir, bus, "information")) as fh:
                for line in fh:
                    key, _, value = line.partition(":")
                    if key.strip() == "Device Minor" and value.strip().isdigit():
                        info["minor"] = int(value)
                    elif key.strip() == "GPU UUID":
                        info["uuid"] = value.strip()
        except OSError:
            continue
        if info["minor"] is not None:
            out.append(info)
    return out


def gpu_plan(present: list[str], gpu_ids: list[str], gpus: list[dict[str, Any]]) -> tuple[list[str], list[str]]:
    """Pure: which NVIDIA nodes a stage gets, and its CUDA_VISIBLE_DEVICES inside the sandbox.

    `present`: the NVIDIA entries of /dev, relative to it ("nvidia0", "nvidiactl",
    "nvidia-caps/nvidia-cap1"); `gpu_ids`: the stage's assignment (CUDA_VISIBLE_DEVICES: indices
    or GPU-UUIDs); `gpus`: `nvidia_gpus()`. Returns (the control nodes present, the caps nodes and
    `nvidia<minor>` of each assigned GPU only; the ids to use inside: the UUIDs where the driver
    names them, which select the same GPU whether or not CUDA renumbers the GPUs it can open, else
    0..k-1, the numbering of the only nodes it can open). Raises OSError (ENODEV) for an id that names no
    node here (a MIG id, an unknown UUID, an index past the GPUs): never all GPUs instead.
    """
    have = set(present)
    nodes = [n for n in GPU_CONTROL_NODES if n in have]
    nodes += sorted(n for n in have if n.startswith("nvidia-caps/"))
    own: list[str] = []
    inside: list[str] = []
    for raw in gpu_ids:
        gid = raw.strip()
        if not gid:
            continue
        if gid.isdigit():
            i = int(gid)
            if gpus and i >= len(gpus):
                raise OSError(errno.ENODEV, f"GPU {gid} of CUDA_VISIBLE_DEVICES: the driver lists {len(gpus)} GPU(s)")
            info = gpus[i] if gpus else {"minor": i, "uuid": None}
        elif gid.startswith("GPU-"):
            found = [g for g in gpus if g["uuid"] and g["uuid"].startswith(gid)]
            if len(found) != 1:
                raise OSError(errno.ENODEV, f"GPU {gid} of CUDA_VISIBLE_DEVICES: "
                                             f"{'no' if not found else 'more than one'} GPU of the driver has that UUID")
            info = found[0]
        else:
            raise OSError(errno.ENODEV, f"GPU {gid!r} of CUDA_VISIBLE_DEVICES: the sandbox binds a whole GPU "
                                         "by index or GPU-UUID (MIG ids are not supported)")
        node = f"nvidia{info['minor']}"
        if node not in have:
            raise OSError(errno.ENODEV, f"GPU {gid} of CUDA_VISIBLE_DEVICES: no /dev/{node}")
        if node not in own:
            own.append(node)
            inside.append(info["uuid"] or "")
    if not own:
        raise OSError(errno.ENODEV, "[run] gpus > 0 but the stage was assigned no GPU (CUDA_VISIBLE_DEVICES is empty)")
    if not all(inside):
        inside = [str(k) for k in range(len(own))]
    return nodes + own, inside


def nvidia_nodes(dev: str = "/dev") -> list[str]:
    """The NVIDIA entries of `dev`, relative to it: nodes, and those in the nvidia-caps folder."""
    out = []
    try:
        names = os.listdir(dev)
    except OSError:
        return []
    for n in names:
        if not n.startswith("nvidia"):
            continue
        if os.path.isdir(os.path.join(dev, n)):
            if n == "nvidia-caps":
                out += [f"{n}/{c}" for c in os.listdir(os.path.join(dev, n))
                        if not os.path.isdir(os.path.join(dev, n, c))]
        else:
            out.append(n)
    return sorted(out)


def gpu_devices(gpu_ids: list[str], dev: str = "/dev", proc_dir: str = NVIDIA_PROC) -> tuple[list[str], list[str]]:
    """`gpu_plan` on this machine's /dev and driver."""
    return gpu_plan(nvidia_nodes(dev), gpu_ids, nvidia_gpus(proc_dir))


def stage_gpu_ids(spec: dict[str, Any]) -> list[str]:
    """The GPUs assigned to the stage: the spec's `gpu_ids` (the executor's choice), else ours."""
    ids = spec.get("gpu_ids")
    if ids is None:
        ids = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")
    return [str(g).strip() for g in ids if str(g).strip() and str(g).strip() != "-1"]


def sysfs_paths() -> list[str]:
    """What of /sys a multi-GPU stage sees, read-only: `SYSFS` and the PCI root complexes (those present)."""
    try:
        roots = sorted(f"/sys/devices/{n}" for n in os.listdir("/sys/devices") if n.startswith("pci"))
    except OSError:
        roots = []
    return [p for p in (*roots, *SYSFS) if os.path.isdir(p)]


def needs_sysfs(spec: dict[str, Any]) -> bool:
    """Whether the stage sees the machine's device tree (`SYSFS`, read-only): `spec["sysfs"]`, by
    default a stage of 2 GPUs or more (NCCL reads the PCI topology there, and fails without it)."""
    return bool(spec.get("sysfs", float(spec.get("gpus") or 0) >= 2))


def device_nodes(spec: dict[str, Any], dev: str = "/dev", proc_dir: str = NVIDIA_PROC) -> list[str]:
    """The /dev entries (relative to `dev`) bound into the sandbox: the basic ones and, with
    `gpus`, the NVIDIA control nodes and the stage's own GPUs only."""
    devices = list(DEVICES)
    if spec.get("gpus"):
        devices += gpu_devices(stage_gpu_ids(spec), dev, proc_dir)[0]
    return devices


def _private_root(tries: int = 6) -> None:
    """Make every mount of this (new) namespace private, so nothing done here reaches the host's.
    The kernel answers EBUSY now and then while the host's mount tree changes under the copy (a
    full suite's parallel sandboxes and Ray: once in 745 tests): tried again after a moment."""
    for i in range(tries):
        try:
            _mount(None, "/", None, MS_REC | MS_PRIVATE)
            return
        except OSError as e:
            if e.errno != errno.EBUSY or i == tries - 1:
                raise
            time.sleep(0.01 * 2 ** i)


def _build_root(spec: dict[str, Any]) -> str:
    """The new root, on a tmpfs: the system read-only, /dev, a private /tmp, the Python environment
    read-only (it may live under /tmp), our package and the lab masked inside what is mounted, then
    the stage's own binds (which may lie under a mask)."""
    env, stage = _plan(spec)
    root = _newroot_mountpoint([*env, *(p for p, _ in stage)])
    _private_root()
    _mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=16m")
    for path in SYSTEM_RO:
        if os.path.islink(path):
            os.symlink(os.readlink(path), root + path)
        elif os.path.isdir(path):
            _bind(path, _makedirs_in(root, path), readonly=True)
    dev = _makedirs_in(root, "/dev")
    _mount("tmpfs", dev, "tmpfs", MS_NOSUID, "mode=0755,size=1m")
    devices = device_nodes(spec)
    for name in devices:
        if os.path.exists(f"/dev/{name}"):
            _bind(f"/dev/{name}", _makedirs_in(root, f"/dev/{name}", as_file=True), readonly=False)
    for link, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2")):
        os.symlink(target, f"{dev}/{link}")
    _mount("tmpfs", _makedirs_in(root, "/dev/shm"), "tmpfs", MS_NOSUID | MS_NODEV, f"mode=1777,size={int(spec['shm_max_mb'])}m")
    if needs_sysfs(spec):  # NCCL finds how the GPUs connect there (realpath of /sys/class/pci_bus/…)
        for path in sysfs_paths():
            _bind(path, _makedirs_in(root, path), readonly=True)
    _mount("tmpfs", _makedirs_in(root, "/tmp"), "tmpfs", MS_NOSUID | MS_NODEV,
           f"mode=1777,size={int(spec['tmp_max_mb'])}m")
    for path in env:
        _bind(path, _makedirs_in(root, path), readonly=True)
    bound = [*env, *(p for p in SYSTEM_RO if not os.path.islink(p))]
    masks = []
    for path in hidden_paths(spec):  # e.g. our own package inside site-packages, a lab under /opt
        if not any(path == b or path.startswith(b.rstrip("/") + "/") for b in bound):
            continue  # not inside anything mounted: invisible already
        inside = root + path
        if os.path.isdir(inside):  # writable until the stage's binds below have their mount points
            _mount("tmpfs", inside, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=1m")
            masks.append(inside)
        elif os.path.lexists(inside):
            _mount("/dev/null", inside, None, MS_BIND)
    for path, mode in stage:
        if mode == "out":
            _mount("tmpfs", _makedirs_in(root, path), "tmpfs", MS_NOSUID | MS_NODEV,
                   f"mode=0755,uid=0,gid=0,size={int(spec['out_max_mb'])}m")
        elif os.path.exists(path):
            dst = _makedirs_in(root, path, as_file=not os.path.isdir(path))
            _bind(path, dst, readonly=mode == "ro")
        else:
            raise OSError(errno.ENOENT, f"sandbox mount {path}: no such file or folder")
    for inside in masks:
        _mount(None, inside, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    _makedirs_in(root, "/proc")
    return root


def _pivot(root: str) -> None:
    """Make `root` the root of the mount namespace (the outer process moves with it)."""
    # a new proc may only be mounted while a full one is visible: before the old root goes
    _mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    os.chdir(root)
    _check(_libc.syscall(SYS_PIVOT_ROOT, b".", b"."), "pivot_root")
    _check(_libc.umount2(b".", MNT_DETACH), "detach the old root")
    os.chdir("/")
    _mount(None, "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)


def _copy_out(src: str, dst_fd: int, log: list[str], budget: list[int]) -> None:
    """Copy regular files and folders from the stage's tmpfs into the real output folder.

    `budget` is [bytes left, entries left]: a sparse file's holes would be written out in full.
    """
    for name in sorted(os.listdir(src)):
        budget[1] -= 1
        if budget[1] < 0:
            raise OSError(errno.EFBIG, f"more than {MAX_OUT_FILES} files and folders in the output")
        path = os.path.join(src, name)
        st = os.lstat(path)
        if stat.S_ISDIR(st.st_mode):
            os.mkdir(name, 0o755, dir_fd=dst_fd)
            sub = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=dst_fd)
            try:
                _copy_out(path, sub, log, budget)
            finally:
                os.close(sub)
        elif stat.S_ISREG(st.st_mode) and st.st_nlink == 1:
            budget[0] -= st.st_size
            if budget[0] < 0:
                raise OSError(errno.EFBIG, "the output's files add up to more than [run] out_max_mb")
            fin = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
            fout = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644, dir_fd=dst_fd)
            try:
                while chunk := os.read(fin, 1 << 20):
                    os.write(fout, chunk)
            finally:
                os.close(fin)
                os.close(fout)
        else:
            kind = ("symlink" if stat.S_ISLNK(st.st_mode) else "hard link" if stat.S_ISREG(st.st_mode)
                    else "special file")
            log.append(f"sandbox: {path} is a {kind}; not kept in the output (only regular files are)")


def enter(spec: dict[str, Any], handshake: tuple[int, int] | None = None) -> None:
    """Enter the sandbox. Returns only in the stage's process; this one exits as the stage does.

    The process that calls this becomes the `outer` one: new user, mount, pid, ipc, uts and
    (unless allowed) network namespaces; it builds the root, starts the namespace's init (a
    `cat` reading a pipe: spawned, not forked, so it costs no copy of this big process) and forks
    the stage. Only a process outside the new user namespace may map a uid other than its own,
    so a parent maps ours: the warm worker does it (`handshake` = our ends of the two pipes
    of `map_child`), else a forked helper of our own. A set-up failure prints one line to the log
    and exits with SETUP_FAILED before any branch code runs.
    """
    spec = {**DEFAULTS, **spec}
    uid = os.getuid()
    out_fd = os.open(spec["out"], os.O_RDONLY | os.O_DIRECTORY) if spec.get("out") else None
    nproc = int(spec["max_procs"]) + (_user_procs(uid) if uid != 0 else 0)
    flags = CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS
    if not spec["network"]:
        flags |= CLONE_NEWNET
    ready_w, go_r = handshake if handshake is not None else _fork_mapper()
    try:
        _check(_libc.unshare(flags), "unshare")
        os.write(ready_w, b"k")
        if os.read(go_r, 1) != b"k":
            _fail("the uid map was refused")
        if not spec["network"]:
            try:
                _loopback_up()
            except OSError as e:  # some container runtimes refuse it: the stage runs, without loopback
                print(f"sandbox: loopback stays down ({e}); a stage that talks to itself (torchrun) cannot",
                      file=sys.stderr)
        root = _build_root(spec)
        os.chdir(root)  # the init inherits this cwd: nothing of it points into the old root
        init_r, init_w = os.pipe()
        init = os.posix_spawn(INIT[0], list(INIT), {}, file_actions=[
            (os.POSIX_SPAWN_DUP2, init_r, 0), (os.POSIX_SPAWN_OPEN, 1, "/dev/null", os.O_WRONLY, 0)])
    except OSError as e:
        _fail(str(e))
    os.close(init_r)
    for fd in (ready_w, go_r):
        os.close(fd)
    stage = os.fork()
    if stage == 0:
        os.close(init_w)
        _become_stage(root, out_fd, uid, nproc, max(int(spec["out_max_mb"]), int(spec["tmp_max_mb"])) << 20)
        return
    _wait_and_exit(stage, init, spec, out_fd)


def uid_base(files: tuple[str, ...] = SUBID_FILES) -> int:
    """The first kuid of the stages' range: UID_FLOOR, or above the highest subordinate id range."""
    top = UID_FLOOR
    for path in files:
        try:
            with open(path) as fh:
                for line in fh:
                    parts = line.strip().split(":")
                    if len(parts) == 3 and parts[1].isdigit() and parts[2].isdigit():
                        top = max(top, int(parts[1]) + int(parts[2]))
        except OSError:
            continue
    if top + PID_MAX_LIMIT >= 2**32 - 1:
        raise OSError(errno.ERANGE, "no uid range above /etc/subuid and /etc/subgid is left for stages")
    return top


def stage_uid(pid: int, files: tuple[str, ...] = SUBID_FILES) -> int:
    """The kuid (and kgid) of the stage whose sandbox process is `pid`, when we are root."""
    return uid_base(files) + pid


def _loopback_up() -> None:
    """Bring up `lo` in the stage's own network namespace (a new one starts with it down): a stage
    without the network still talks to itself, as torchrun's rendezvous and NCCL/gloo need."""
    import fcntl
    import socket
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        flags = struct.unpack("16sH", fcntl.ioctl(sock, SIOCGIFFLAGS, struct.pack("16sH", b"lo", 0)))[1]
        fcntl.ioctl(sock, SIOCSIFFLAGS, struct.pack("16sH", b"lo", flags | IFF_UP))


def map_child(pid: int, ready_r: int, go_w: int) -> None:
    """In the parent: wait until `pid` has its user namespace, then write its uid and gid maps.

    As root, the stage runs as a uid of its own (`stage_uid`), and our own uid is mapped too
    (to 1), so that the outer process, still uid 0, can build the root and read the bind
    sources. Otherwise the stage keeps our uid (the only one we may map).
    """
    try:
        if os.read(ready_r, 1) != b"k":
            return  # it failed before unsharing; it says why in its log
        uid, gid = os.getuid(), os.getgid()
        inner_uid = stage_uid(pid) if uid == 0 else uid
        inner_gid = stage_uid(pid) if uid == 0 else gid
        extra = "1 0 1\n" if uid == 0 else ""
        if uid != 0:
            _write(f"/proc/{pid}/setgroups", "deny")
        _write(f"/proc/{pid}/uid_map", f"0 {inner_uid} 1\n{extra}")
        _write(f"/proc/{pid}/gid_map", f"0 {inner_gid} 1\n{extra}")
        os.write(go_w, b"k")
    except OSError as e:
        print(f"sandbox: uid map of {pid}: {e}", file=sys.stderr)
    finally:
        os.close(ready_r)
        os.close(go_w)


def _fork_mapper() -> tuple[int, int]:
    """No parent of ours maps us: fork one that does, then waits and exits as we do."""
    ready_r, ready_w = os.pipe()
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(ready_r)
        os.close(go_w)
        return ready_w, go_r
    os.close(ready_w)
    os.close(go_r)
    map_child(pid, ready_r, go_w)
    _wait_and_exit(pid, None, None, None)


def _wait(pid: int) -> int:
    while True:
        try:
            return os.waitpid(pid, 0)[1]
        except InterruptedError:
            continue
        except ChildProcessError:
            return 1 << 8


def _fail(reason: str) -> NoReturn:
    print(f"sandbox: cannot set up ({reason}); {OFF_HINT}", file=sys.stderr)
    sys.stderr.flush()
    os._exit(SETUP_FAILED)


def _become_stage(root: str, out_fd: int | None, outer_uid: int, nproc: int, max_file: int) -> None:
    import resource

    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if out_fd is not None:
        os.close(out_fd)
    try:
        _pivot(root)
        if outer_uid == 0:
            os.setgroups([])
        os.setresgid(0, 0, 0)
        os.setresuid(0, 0, 0)
        resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
        # no file the stage writes grows past its largest folder, its log (a host file) included
        resource.setrlimit(resource.RLIMIT_FSIZE, (max_file, max_file))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        _drop_capabilities()
    except OSError as e:
        _fail(str(e))


def _wait_and_exit(pid: int, init: int | None, spec: dict[str, Any] | None, out_fd: int | None) -> NoReturn:
    """Wait for `pid`; as the outer process, end its namespace and keep what the stage wrote; exit
    as `pid` did."""
    import resource

    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    for sig in (signal.SIGINT, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_IGN)
    status = _wait(pid)
    code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else 1
    if init is not None:  # the stage is done: whatever it left behind dies with its namespace
        os.kill(init, signal.SIGKILL)
        _wait(init)  # returns once every process of the namespace is gone
    if spec is not None:  # the outer process: `pid` ran branch code, so 125 is not ours to pass on
        if code == SETUP_FAILED:
            code = 1
        if out_fd is not None and os.WIFEXITED(status) and code == 0:
            notes: list[str] = []
            try:
                _copy_out(spec["out"], out_fd, notes, [int(spec["out_max_mb"]) << 20, MAX_OUT_FILES])
            except OSError as e:  # EFBIG: over out_max_mb or MAX_OUT_FILES, the stage's doing (a method failure)
                too_large = e.errno == errno.EFBIG
                notes.append(f"sandbox: output not kept: {e.strerror}" if too_large else
                             f"sandbox: copying the output failed: {e}")
                code = 1 if too_large else SETUP_FAILED
            for line in notes:
                print(line, file=sys.stderr)
            sys.stderr.flush()
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if spec is not None and sig in STAGE_SIGNALS_AS_EXIT:
            # the stage was killed and we were not: it killed itself (or a process of its own did).
            # A kill from the machinery reaches this process too (its process group), so passing the
            # signal on would let branch code turn its own failures into retried infrastructure ones.
            print(f"sandbox: the stage died of signal {sig} that the sandbox did not receive", file=sys.stderr)
            os._exit(128 + sig)
        signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    os._exit(code)
