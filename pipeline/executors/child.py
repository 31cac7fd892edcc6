"""Set up and run one stage in the current process. Standard library only, on purpose.

Both executors start a stage through this file: the local executor calls `run()` in a child
forked from its warm worker (torch and peft already imported), and the Ray executor runs this
file's source with `python -c` on whatever node Ray picked, where our package may not be installed.
One code path means one set of guarantees: own process group, scrubbed environment, thread
count, memory limit, logs to a file, and `python SCRIPT args` run in-process through runpy.

The spec is a JSON-able dict: argv, cwd, env (the complete environment), log (a file path),
cpus, memory_mb (None for no limit), stdout (a file for stdout apart from the log), strip_sys_path (where our own packages lie: hidden from the stage, `hide_own_packages`), and sandbox:
None (unsandboxed: the lab opted out) or the mounts and limits of `sandbox.enter` (sandbox.py;
`sandbox_src` carries its source where our package is not installed).
"""

from __future__ import annotations

import functools
import json
import os
import sys
from typing import Any, NoReturn

try:
    from pipeline.executors import sandbox as _sandbox
except ImportError:  # run from source (`python -c`) on a node without our package
    _sandbox = None

PR_SET_PDEATHSIG = 1
PYTHON_NAMES = {"python", "python3", f"python{sys.version_info[0]}.{sys.version_info[1]}"}
# the BLAS libraries' thread-count setters (numpy's wheels: scipy_openblas64_; conda: MKL; BLIS), by the
# name a loaded library's file carries
BLAS_SET_THREADS = {
    "openblas": ("scipy_openblas_set_num_threads64_", "openblas_set_num_threads64_", "openblas_set_num_threads",
                 "scipy_openblas_set_num_threads"),
    "mkl_rt": ("MKL_Set_Num_Threads",),
    "blis": ("bli_thread_set_num_threads",),
}
OWN_PACKAGES = ("pipeline", "agent")  # what a stage must not import from the driver's install
THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMEXPR_NUM_THREADS",
               "VECLIB_MAXIMUM_THREADS", "TORCH_NUM_THREADS")


def python_target(argv: list[str]) -> tuple[str, str, list[str]] | None:
    """("path", script, args) for `python SCRIPT args`, ("module", name, args) for `python -m`."""
    if not argv or (os.path.basename(argv[0]) not in PYTHON_NAMES and argv[0] != sys.executable):
        return None
    rest = argv[1:]
    if len(rest) >= 2 and rest[0] == "-m":
        return ("module", rest[1], rest[2:])
    if rest and not rest[0].startswith("-"):
        return ("path", rest[0], rest[1:])
    return None


def _die_with_parent(sig: int = 9) -> None:
    """Ask the kernel to send `sig` (default SIGKILL) when the process that started us dies (Linux)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, sig)
    except (OSError, AttributeError):
        pass


def _vm_size_bytes() -> int:
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmSize:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _limit_memory(memory_mb: int | None, in_process: bool) -> None:
    """RLIMIT_AS: a stage run in-process may grow its address space by memory_mb beyond what the
    warm worker already maps (torch reserves a lot of virtual memory it never touches)."""
    if not memory_mb:
        return
    import resource

    limit = memory_mb * 2**20 + (_vm_size_bytes() if in_process else 0)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


_BLAS_SETTERS: list[Any] | None = None  # found once in a warm worker (`prepare_fork`), inherited by its forks


def _blas_setters() -> list[Any]:
    """The thread-count setter of every BLAS loaded in this process (numpy's OpenBLAS, MKL, BLIS)."""
    global _BLAS_SETTERS
    if _BLAS_SETTERS is not None:
        return _BLAS_SETTERS
    import ctypes

    setters: list[Any] = []
    try:
        with open("/proc/self/maps") as fh:
            libs = {line.split()[-1] for line in fh if "/" in line}
    except OSError:
        libs = set()
    for lib in sorted(libs):
        name = lib.rsplit("/", 1)[-1].lower()
        symbols = next((names for kind, names in BLAS_SET_THREADS.items() if kind in name), None)
        if symbols is None:
            continue
        try:
            handle = ctypes.CDLL(lib, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        except OSError:
            continue
        found = next((getattr(handle, sym) for sym in symbols if hasattr(handle, sym)), None)
        if found is not None:
            setters.append(found)
    _BLAS_SETTERS = setters
    return setters


def _set_blas_threads(cpus: int) -> None:
    """Size the thread pool of every BLAS already loaded (numpy's, in a warm worker that imported it
    with one thread, so that it forks a single-threaded process): what threadpoolctl does."""
    import ctypes

    for setter in _blas_setters():
        setter(ctypes.c_int(cpus))


def prepare_fork() -> None:
    """In a warm worker, after its preload: look up now, once, what each forked stage would (the BLAS
    setters, the interpreter's site folders, our modules among the thousands imported), so a stage's
    start costs none of it: reading them in the child copies the pages it touches."""
    _blas_setters()
    _site_dirs()
    _OWN.extend(m for m in sys.modules if m.partition(".")[0] in OWN_PACKAGES)


_OWN: list[str] = []  # our modules imported by the warm worker (`prepare_fork`)


def _own_modules() -> list[str]:
    return _OWN or [m for m in sys.modules if m.partition(".")[0] in OWN_PACKAGES]


@functools.lru_cache(maxsize=1)
def _site_dirs() -> frozenset[str]:
    import site

    return frozenset(os.path.realpath(d) for d in [*site.getsitepackages(), site.getusersitepackages()])


def _set_threads(cpus: int) -> None:
    _set_blas_threads(cpus)
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(cpus)
        try:
            torch.set_num_interop_threads(cpus)
        except RuntimeError:  # already set in this process: harmless
            pass


def _sandbox_module(spec: dict[str, Any]) -> Any:
    if _sandbox is not None:
        return _sandbox
    import types

    mod = types.ModuleType("autoresearch_sandbox")
    exec(compile(spec["sandbox_src"], "sandbox.py", "exec"), mod.__dict__)
    return mod


class _WithoutOwnPackages:
    """The finder of one `sys.path` entry (a `site-packages` that also holds our packages), blind to
    `OWN_PACKAGES`: the import system then looks further along the path, as for any absent module."""

    def __init__(self, inner: Any):
        self.inner = inner

    def find_spec(self, name: str, target: Any = None) -> Any:
        if name.partition(".")[0] in OWN_PACKAGES:
            return None
        return self.inner.find_spec(name, target)

    def invalidate_caches(self) -> None:
        self.inner.invalidate_caches()


def _under(path: str | None, roots: list[str]) -> bool:
    where = os.path.realpath(path or "")
    return bool(path) and any(where == r or where.startswith(r.rstrip(os.sep) + os.sep) for r in roots)


def hide_own_packages(roots: list[str]) -> None:
    """Make our own packages (`OWN_PACKAGES`, installed under `roots`: where `pipeline/` lies)
    invisible to the stage, wherever they were installed from: a source tree leaves `sys.path`;
    a `site-packages` (a wheel install) stays, since the lab's libraries live there too, and is
    searched by a finder that does not see ours; an editable install's own finder leaves
    `sys.meta_path`. A lab module of the same name still imports."""
    if not roots:
        return
    roots = [os.path.realpath(r) for r in roots]
    sites = _site_dirs()
    sys.path[:] = [p for p in sys.path if p != "" and (os.path.realpath(p) not in roots or os.path.realpath(p) in sites)]
    for entry in sys.path:
        if os.path.realpath(entry) in roots:
            for hook in sys.path_hooks:
                try:
                    sys.path_importer_cache[entry] = _WithoutOwnPackages(hook(entry))
                    break
                except ImportError:
                    continue
    for finder in list(sys.meta_path):  # e.g. setuptools' __editable___autoresearch_finder
        if getattr(finder, "__module__", "").startswith("_frozen_importlib"):
            continue
        try:
            found = finder.find_spec(OWN_PACKAGES[0], None)
        except Exception:
            continue
        if found is not None and _under(found.origin or next(iter(found.submodule_search_locations or []), None), roots):
            sys.meta_path.remove(finder)
    for mod in _own_modules():
        sys.modules.pop(mod, None)


STAGE_OOM_SCORE_ADJ = 1000  # a stage is the OOM killer's first victim, never a warm worker


def set_oom_score_adj(value: int) -> bool:
    """Write /proc/self/oom_score_adj; False where not permitted (lowering it needs privilege)."""
    try:
        with open("/proc/self/oom_score_adj", "w") as fh:
            fh.write(str(value))
        return True
    except OSError:
        return False


def run(spec: dict[str, Any], *, new_session: bool, handshake: tuple[int, int] | None = None) -> NoReturn:
    """Become the stage: never returns; the exit status is the stage's.

    `handshake`: the pipe ends through which a parent maps our user namespace (sandbox.map_child).
    """
    code = 1
    try:
        if new_session:
            os.setsid()
        _die_with_parent()
        set_oom_score_adj(STAGE_OOM_SCORE_ADJ)  # raising it is always permitted; inherited by all it starts
        log_fd = os.open(spec["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        null_fd = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null_fd, 0)
        if spec.get("stdout"):  # a scorer's stdout is its answer: kept apart from its chatter
            out_fd = os.open(spec["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(out_fd, 1)
            os.close(out_fd)
        else:
            os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        os.close(log_fd)
        os.close(null_fd)
        if spec.get("sandbox") is not None:
            sandbox = _sandbox_module(spec)
            try:
                sandbox.enter(spec["sandbox"], handshake)
            except OSError as e:
                print(f"sandbox: cannot set up ({e}); {sandbox.OFF_HINT}", file=sys.stderr)
                os._exit(sandbox.SETUP_FAILED)
        os.chdir(spec["cwd"])
        env = dict(spec["env"])
        if spec.get("sandbox") is not None:  # the only home and temp a sandboxed stage has
            env.update(HOME="/tmp", TMPDIR="/tmp")
        os.environ.clear()
        os.environ.update(env)
        argv: list[str] = list(spec["argv"])
        target = python_target(argv)
        _limit_memory(spec.get("memory_mb"), in_process=target is not None)
        if target is None:
            if os.path.basename(argv[0]) in PYTHON_NAMES:
                argv[0] = sys.executable
            import signal

            for name in ("SIGPIPE", "SIGXFSZ"):  # Python ignores these; a program expects defaults
                if hasattr(signal, name):
                    signal.signal(getattr(signal, name), signal.SIG_DFL)
            try:
                os.execvpe(argv[0], argv, env)
            except OSError as e:
                print(f"cannot execute {argv[0]!r}: {e}", file=sys.stderr)
                os._exit(127)
        import runpy

        _set_threads(int(spec.get("cpus", 1)))
        kind, name, args = target
        hide_own_packages(spec.get("strip_sys_path", []))
        if kind == "path":
            script = os.path.abspath(name)
            sys.argv = [script, *args]
            sys.path.insert(0, os.path.dirname(script))
            runpy.run_path(script, run_name="__main__")
        else:
            sys.argv = [name, *args]
            sys.path.insert(0, os.getcwd())
            runpy.run_module(name, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as e:
        if e.code is None:
            code = 0
        elif isinstance(e.code, int):
            code = e.code
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except Exception:
            pass
    os._exit(code & 0xFF)


if __name__ == "__main__":  # `python -c SOURCE SPEC_JSON` (the Ray executor)
    run(json.loads(sys.argv[1]), new_session=False)
