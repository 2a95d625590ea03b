"""Static resources of linattn_nb's CUDA kernels on sm_90 (H100/H200), measured without a GPU.

A kernel that needs more registers or shared memory than a block may have
fails at launch ("too many resources requested for launch") on real hardware,
while the simulator and ``numba.cuda.compile_ptx`` accept it: registers,
spills and the final shared-memory size appear only when ``ptxas`` assembles
the PTX for a real architecture.  This module does that, for the tests
(``tests/ops/test_cuda_launchable.py``) and for ``benchmarks/gpu_static.py``.

It is a development tool, not part of the installed package: it lives in the
checkout's ``tools/`` folder (next to ``tools/mutate.py``) and uses
``linattn_nb`` as an ordinary client, so the package never imports it and no
import cycle runs through it.  ``tools/`` is no package (``tools`` is a name
other distributions install too); its users put the folder on ``sys.path`` and
``import cuda_resources``, and :func:`measure` runs this file as a script
(``--worker``) for its compiling subprocesses.

* :func:`find_tool` locates ``ptxas`` (the ``nvidia-cuda-nvcc-cu12`` wheel,
  which the ``cuda`` extra installs through ``numba-cuda[cu12]``), and
  ``nvdisasm`` / ``cuobjdump`` when some wheel or toolkit provides them (the
  ``nvidia-cuda-nvdisasm`` and ``nvidia-cuda-cuobjdump`` wheels do).
* :class:`KernelSpec` names a kernel of the package, the Numba signature it
  is launched with and its threads per block; the catalogue functions
  (:func:`sequence_spec`, :func:`sequence_configurations`,
  :func:`helper_specs`, :func:`backward_specs`, :func:`step_specs`) list the
  configurations the launchers choose.
* :func:`measure` compiles specs to sm_90 PTX (``compile_ptx`` with the
  kernel's own ``cuda.jit`` options, in subprocesses with the simulator off),
  assembles them with ``ptxas -v`` (``max_registers`` becomes
  ``-maxrregcount``), parses registers, spills, stack and static shared memory
  (:func:`parse_ptxas`), optionally disassembles the cubin (SASS), and caches
  the results on disk keyed on the package sources, this file, the Numba and
  ptxas versions and the spec.
* :data:`SM90` holds the limits of a compute-capability 9.0 multiprocessor;
  :func:`occupancy` is the resident blocks and warps per multiprocessor from
  registers, shared memory and threads; :func:`launch_problems` lists why a
  block cannot launch.
* :func:`sass_loops` finds the loops of a SASS listing (a backward branch
  closes one) and :func:`opcode_mix` counts their instructions.

Nothing here needs a GPU or imports ``numba.cuda`` at module level.
"""
from __future__ import annotations

import dataclasses
import functools
import glob
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass, field


# ---------------------------------------------------------------------------
# sm_90 limits and occupancy
# ---------------------------------------------------------------------------
@dataclass(frozen=True)
class GpuLimits:
    """Per-block and per-multiprocessor limits of one compute capability (CUDA C Programming Guide,
    "Compute Capabilities", and the occupancy calculator's allocation rules)."""

    name: str
    regs_per_sm: int
    regs_per_block: int
    regs_per_thread: int
    reg_alloc_unit: int  # registers are allocated per warp in units of this many
    static_shared_per_block: int
    optin_shared_per_block: int
    shared_per_sm: int
    shared_reserved_per_block: int  # the runtime's share of every block's shared memory
    shared_alloc_unit: int
    warps_per_sm: int
    blocks_per_sm: int
    threads_per_block: int
    warp_size: int = 32


#: Compute capability 9.0 (H100, H200).
SM90 = GpuLimits(name="sm_90", regs_per_sm=65536, regs_per_block=65536, regs_per_thread=255, reg_alloc_unit=256,
                 static_shared_per_block=48 * 1024, optin_shared_per_block=227 * 1024,
                 shared_per_sm=228 * 1024, shared_reserved_per_block=1024, shared_alloc_unit=128,
                 warps_per_sm=64, blocks_per_sm=32, threads_per_block=1024)


def _ceil_to(x: int, unit: int) -> int:
    return -(-int(x) // unit) * unit


def block_registers(registers: int, threads: int, limits: GpuLimits = SM90) -> int:
    """Registers a block of ``threads`` threads occupies: ``registers`` per thread, allocated per warp
    in units of ``limits.reg_alloc_unit`` (at least ``registers * threads``)."""
    warps = -(-int(threads) // limits.warp_size)
    return warps * _ceil_to(int(registers) * limits.warp_size, limits.reg_alloc_unit)


@dataclass(frozen=True)
class Occupancy:
    """Resident blocks and warps of one kernel per multiprocessor, and what limits them."""

    blocks: int
    warps: int
    limiter: str
    by_registers: int
    by_shared: int
    by_warps: int


def occupancy(registers: int, threads: int, shared: int = 0, limits: GpuLimits = SM90) -> Occupancy:
    """Resident blocks and warps per multiprocessor.

    Parameters
    ----------
    registers : int
        Registers per thread (ptxas).
    threads : int
        Threads per block.
    shared : int
        Shared memory per block in bytes, static plus dynamic.
    limits : GpuLimits
        The architecture (default :data:`SM90`).

    Returns
    -------
    Occupancy
        ``blocks`` = the smallest of the limits by registers, shared memory,
        warps and ``limits.blocks_per_sm`` (0: the block cannot launch),
        ``warps`` = ``blocks`` times the warps of a block, and ``limiter``
        naming the binding limit.
    """
    warps_per_block = -(-int(threads) // limits.warp_size)
    if threads < 1 or warps_per_block == 0:
        raise ValueError(f"threads must be >= 1, got {threads}")
    per_warp = _ceil_to(max(int(registers), 1) * limits.warp_size, limits.reg_alloc_unit)
    by_regs = (limits.regs_per_sm // per_warp) // warps_per_block
    if registers > limits.regs_per_thread or per_warp * warps_per_block > limits.regs_per_block:
        by_regs = 0
    smem = _ceil_to(int(shared) + limits.shared_reserved_per_block, limits.shared_alloc_unit)
    by_shared = limits.shared_per_sm // smem if shared <= limits.optin_shared_per_block else 0
    by_warps = limits.warps_per_sm // warps_per_block if threads <= limits.threads_per_block else 0
    cands = {"registers": by_regs, "shared memory": by_shared, "warps": by_warps,
             "blocks per SM": limits.blocks_per_sm}
    limiter = min(cands, key=lambda k: cands[k])
    blocks = cands[limiter]
    return Occupancy(blocks, blocks * warps_per_block, limiter, by_regs, by_shared, by_warps)


def launch_problems(registers: int, threads: int, static_shared: int, dynamic_shared: int = 0,
                    limits: GpuLimits = SM90) -> list[str]:
    """Why a block of this kernel cannot launch (an empty list when it can).

    Checks threads per block, registers per thread, the block's registers
    (allocated per warp, :func:`block_registers`) against the registers of a
    block, static shared memory against the static limit and static plus
    dynamic against the opt-in limit.
    """
    out = []
    if threads > limits.threads_per_block:
        out.append(f"{threads} threads > {limits.threads_per_block} per block")
    if registers > limits.regs_per_thread:
        out.append(f"{registers} registers > {limits.regs_per_thread} per thread")
    regs = block_registers(registers, threads, limits)
    if regs > limits.regs_per_block:
        out.append(f"{registers} registers x {threads} threads = {registers * threads} "
                   f"({regs} allocated) > {limits.regs_per_block} per block")
    if static_shared > limits.static_shared_per_block:
        out.append(f"{static_shared} B static shared > {limits.static_shared_per_block}")
    if static_shared + dynamic_shared > limits.optin_shared_per_block:
        out.append(f"{static_shared} + {dynamic_shared} B shared > {limits.optin_shared_per_block}")
    return out


# ---------------------------------------------------------------------------
# Tools
# ---------------------------------------------------------------------------
def _wheel_bin_dirs() -> list[str]:
    """``bin`` folders of the NVIDIA wheels (``nvidia/cuda_nvcc/bin``, ``nvidia/cu13/bin``, ...)."""
    dirs = []
    try:
        import nvidia  # a namespace package of the NVIDIA wheels

        roots = list(nvidia.__path__)
    except Exception:
        return dirs
    for root in roots:
        for first in ("cuda_nvcc", "cu12", "cu13"):
            dirs.append(os.path.join(root, first, "bin"))
        dirs.extend(sorted(glob.glob(os.path.join(root, "*", "bin"))))
    seen = []
    for d in dirs:
        if d not in seen and os.path.isdir(d):
            seen.append(d)
    return seen


def find_tool(name: str, *, wheels_only: bool = False) -> str | None:
    """Path of a CUDA tool (``ptxas``, ``nvdisasm``, ``cuobjdump``), or None.

    The NVIDIA wheels' ``bin`` folders first (``nvidia-cuda-nvcc-cu12`` has
    ``ptxas``; ``nvidia-cuda-nvdisasm`` and ``nvidia-cuda-cuobjdump`` the
    other two), then, unless ``wheels_only``, ``PATH``, ``$CUDA_HOME/bin`` and
    ``/usr/local/cuda*/bin``.
    """
    exe = name + (".exe" if sys.platform == "win32" else "")

    def first(dirs):
        for d in dirs:
            p = os.path.join(d, exe)
            if os.path.isfile(p) and os.access(p, os.X_OK):
                return p
        return None

    found = first(_wheel_bin_dirs())
    if found or wheels_only:
        return found
    found = shutil.which(name)
    if found:
        return found
    dirs = [os.path.join(os.environ[v], "bin") for v in ("CUDA_HOME", "CUDA_PATH") if os.environ.get(v)]
    return first(dirs + sorted(glob.glob("/usr/local/cuda*/bin"), reverse=True))


@functools.lru_cache(maxsize=None)
def tool_version(path: str | None) -> str:
    """The last line of ``path --version`` ('' when ``path`` is None or fails)."""
    if not path:
        return ""
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return ""
    lines = [ln.strip() for ln in out.stdout.splitlines() if ln.strip()]
    return lines[-1] if lines else ""


# ---------------------------------------------------------------------------
# ptxas -v and SASS parsing
# ---------------------------------------------------------------------------
@dataclass(frozen=True)
class KernelResources:
    """What ``ptxas -v`` reports for one entry function."""

    registers: int
    spill_stores: int
    spill_loads: int
    stack: int
    shared: int  # static shared memory, bytes
    barriers: int = 0

    @property
    def spills(self) -> int:
        """Spill stores plus spill loads, bytes."""
        return self.spill_stores + self.spill_loads


_RE_ENTRY = re.compile(r"Compiling entry function '([^']+)'")
_RE_PROPS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_RE_USED = re.compile(r"Used (\d+) registers")
_RE_SMEM = re.compile(r"(\d+) bytes smem")
_RE_BAR = re.compile(r"used (\d+) barriers")


def parse_ptxas(text: str) -> dict[str, KernelResources]:
    """Entry function name -> :class:`KernelResources` from the output of ``ptxas -v``."""
    res = {}
    name = None
    props = (0, 0, 0)
    for line in text.splitlines():
        m = _RE_ENTRY.search(line)
        if m:
            name, props = m.group(1), (0, 0, 0)
            continue
        m = _RE_PROPS.search(line)
        if m and name is not None:
            props = tuple(int(x) for x in m.groups())
            continue
        m = _RE_USED.search(line)
        if m and name is not None:
            sm = _RE_SMEM.search(line)
            bar = _RE_BAR.search(line)
            res[name] = KernelResources(int(m.group(1)), props[1], props[2], props[0],
                                        int(sm.group(1)) if sm else 0, int(bar.group(1)) if bar else 0)
            name = None
    return res


_RE_INSN = re.compile(r"/\*([0-9a-fA-F]{4,})\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*(?:\.[A-Z0-9_]+)*)([^;]*);")
_RE_LABEL = re.compile(r"^\s*(\.L_x_\d+|\.L_\w+):")
_RE_TARGET_LABEL = re.compile(r"`\((\.L_\w+)\)")
_RE_TARGET_ADDR = re.compile(r"\b0x([0-9a-fA-F]+)\b")


@dataclass(frozen=True)
class SassInsn:
    """One SASS instruction: address, full opcode (with modifiers) and operands."""

    addr: int
    opcode: str
    operands: str

    @property
    def base(self) -> str:
        """The opcode without modifiers (``FFMA.FTZ`` -> ``FFMA``)."""
        return self.opcode.split(".", 1)[0]


def parse_sass(text: str) -> list[SassInsn]:
    """The instructions of a ``nvdisasm -c`` or ``cuobjdump -sass`` listing of one kernel, with branch
    targets resolved to addresses (``operands`` of a branch holds ``-> 0x<target>``)."""
    insns = []
    labels = {}
    pending = []
    for line in text.splitlines():
        m = _RE_LABEL.match(line)
        if m:
            pending.append(m.group(1))
            continue
        m = _RE_INSN.search(line)
        if m:
            addr = int(m.group(1), 16)
            for lab in pending:
                labels[lab] = addr
            pending = []
            insns.append(SassInsn(addr, m.group(2), m.group(3).strip()))
    out = []
    for ins in insns:
        if ins.base in ("BRA", "BRX", "JMP", "JMX") or ins.base.startswith("BRA"):
            t = _RE_TARGET_LABEL.search(ins.operands)
            target = labels.get(t.group(1)) if t else None
            if target is None:
                a = _RE_TARGET_ADDR.search(ins.operands)
                target = int(a.group(1), 16) if a else None
            if target is not None:
                ins = SassInsn(ins.addr, ins.opcode, f"-> 0x{target:x}")
        out.append(ins)
    return out


@dataclass(frozen=True)
class SassLoop:
    """A loop of a SASS listing: the instructions from a branch target to a backward branch to it."""

    start: int
    end: int
    insns: tuple
    innermost: bool

    def mix(self) -> Counter:
        """Base opcode -> count over the loop body (NOPs left out)."""
        return opcode_mix(self.insns)


def opcode_mix(insns) -> Counter:
    """Base opcode -> count of ``insns`` (NOPs left out)."""
    return Counter(i.base for i in insns if i.base != "NOP")


def sass_loops(insns: list[SassInsn]) -> list[SassLoop]:
    """Every loop of a kernel's SASS: a branch at address ``a`` to a target ``t <= a`` closes a loop
    whose body is the instructions at ``t .. a`` (``t < a``: the branch to itself that ends a kernel is
    no loop).  ``innermost``: it contains no other loop."""
    spans = set()
    for ins in insns:
        if ins.operands.startswith("-> 0x"):
            t = int(ins.operands[5:], 16)
            if t < ins.addr:  # t == addr: the BRA-to-itself after the last EXIT, no loop
                spans.add((t, ins.addr))
    spans = sorted(spans)
    loops = []
    for s, e in spans:
        inner = not any((s2, e2) != (s, e) and s <= s2 and e2 <= e for s2, e2 in spans)
        body = tuple(i for i in insns if s <= i.addr <= e)
        loops.append(SassLoop(s, e, body, inner))
    return loops


# ---------------------------------------------------------------------------
# Kernel specs and measurement
# ---------------------------------------------------------------------------
@dataclass
class KernelSpec:
    """One kernel at one launch configuration.

    ``kernel`` is ``"module:attribute"``; with ``factory`` (a tuple, maybe
    empty) the attribute is called with those arguments, and with ``item`` the
    result is indexed (``kernels()["state_step"]``).  The object is a
    ``cuda.jit`` dispatcher (its ``py_func`` and options are used) or a plain
    Python function.  ``sig``: Numba type expressions evaluated in
    ``numba.types`` (``"Array(float32, 4, 'A')"``).  ``threads``: threads per
    block the launcher uses; ``dynamic_shared``: bytes of dynamic shared
    memory.  ``info``: what the spec stands for (shapes, dtype, rule...).
    """

    key: str
    kernel: str
    sig: tuple
    threads: int
    factory: tuple | None = None
    item: str | None = None
    dynamic_shared: int = 0
    group: str = ""
    info: dict = field(default_factory=dict)

    def job(self) -> dict:
        """The JSON-serialisable part the compiling subprocess needs."""
        return {"key": self.key, "kernel": self.kernel, "factory": self.factory, "item": self.item,
                "sig": list(self.sig)}


def _resolve(job: dict):
    import importlib

    mod, attr = job["kernel"].split(":")
    obj = getattr(importlib.import_module(mod), attr)
    if job.get("factory") is not None:
        obj = obj(*job["factory"])
    if job.get("item") is not None:
        obj = obj[job["item"]]
    return obj


def _compile_one(job: dict, ptxas: str, disasm: str | None, workdir: str) -> dict:
    """Compile one job to PTX, assemble it, and optionally disassemble the cubin (in the worker)."""
    import time

    from numba import types
    from numba.cuda import compile_ptx

    obj = _resolve(job)
    fn = getattr(obj, "py_func", obj)
    opts = dict(getattr(obj, "targetoptions", {}) or {})
    ns = {k: getattr(types, k) for k in dir(types) if not k.startswith("_")}
    sig = tuple(eval(s, {"__builtins__": {}}, ns) for s in job["sig"])  # noqa: S307 (our own type strings)
    kw = {}
    if opts.get("launch_bounds") is not None:
        kw["launch_bounds"] = opts["launch_bounds"]
    if opts.get("fastmath"):
        kw["fastmath"] = True
    t0 = time.perf_counter()
    ptx, _ = compile_ptx(fn, sig, cc=(9, 0), **kw)
    t_ptx = time.perf_counter() - t0
    stem = os.path.join(workdir, re.sub(r"[^A-Za-z0-9_.-]", "_", job["key"]))
    with open(stem + ".ptx", "w") as fh:
        fh.write(ptx)
    cmd = [ptxas, "-arch=sm_90", "-v", stem + ".ptx", "-o", stem + ".cubin"]
    if opts.get("max_registers"):
        cmd.insert(2, f"-maxrregcount={int(opts['max_registers'])}")
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        return {"key": job["key"], "error": (proc.stdout + proc.stderr)[-2000:], "ptx_s": t_ptx}
    parsed = parse_ptxas(proc.stdout + proc.stderr)
    if len(parsed) != 1:
        return {"key": job["key"], "error": f"expected one entry function, ptxas reported {list(parsed)}"}
    (name, res), = parsed.items()
    out = {"key": job["key"], "entry": name, "resources": dataclasses.asdict(res), "ptx_s": t_ptx,
           "ptx_local": ("ld.local" in ptx) or ("st.local" in ptx), "target": ".target sm_90" in ptx,
           "max_registers": opts.get("max_registers"), "launch_bounds": opts.get("launch_bounds")}
    if disasm:
        args = [disasm, "-c", stem + ".cubin"] if os.path.basename(disasm).startswith("nvdisasm") else \
            [disasm, "-sass", stem + ".cubin"]
        d = subprocess.run(args, capture_output=True, text=True)
        out["sass"] = d.stdout if d.returncode == 0 else ""
    return out


def _worker() -> None:
    """Subprocess entry: JSON {"jobs", "ptxas", "disasm"} on stdin, one JSON result per line on stdout."""
    req = json.load(sys.stdin)
    with tempfile.TemporaryDirectory() as d:
        for job in req["jobs"]:
            try:
                r = _compile_one(job, req["ptxas"], req.get("disasm"), d)
            except Exception as exc:  # reported per job, the others go on
                r = {"key": job["key"], "error": f"{type(exc).__name__}: {exc}"}
            sys.stdout.write("@@RESULT " + json.dumps(r) + "\n")
            sys.stdout.flush()


@functools.lru_cache(maxsize=None)
def _versions() -> tuple:
    """The package source hash, this file's own hash and the Numba and numba-cuda versions (part of the
    cache key: the package's hash no longer covers this tool, which sets how a kernel is compiled)."""
    import numba

    from linattn_nb._cache import source_hash

    ncv = ""
    try:
        import numba.cuda as nc

        ncv = getattr(nc, "__version__", "")
    except Exception:
        ncv = ""
    try:
        from importlib.metadata import version

        ncv = ncv or version("numba-cuda")
    except Exception:
        pass
    with open(os.path.abspath(__file__), "rb") as fh:
        own = hashlib.sha1(fh.read()).hexdigest()[:16]
    return source_hash(), own, numba.__version__, ncv


def _cache_key(job: dict, ptxas: str) -> str:
    blob = json.dumps([job, *_versions(), tool_version(ptxas), 1], sort_keys=True)
    return hashlib.sha1(blob.encode()).hexdigest()[:20]


def default_cache_dir() -> str | None:
    """``<linattn_nb kernel cache folder>/sm90_resources`` (keyed on the sources already), or None."""
    try:
        from linattn_nb._cache import cache_folder

        folder = cache_folder()[0]
    except Exception:
        folder = None
    return os.path.join(folder, "sm90_resources") if folder else None


def measure(specs, *, ptxas: str | None = None, disasm: str | None = None, sass: bool = False,
            cache_dir: str | None = "default", jobs: int | None = None, timeout: float = 1800) -> dict:
    """Compile, assemble and (``sass``) disassemble ``specs``; return ``key -> result``.

    A result holds ``resources`` (:class:`KernelResources` as a dict),
    ``entry`` (the mangled name), ``ptx_local``, ``ptx_s`` (seconds of PTX
    compilation), ``sass`` (the listing, with ``sass``), or ``error``.
    Compilation runs in ``jobs`` subprocesses (default: the CPU count, at
    most the number of uncached specs) with ``NUMBA_ENABLE_CUDASIM=0``;
    results are cached as JSON files in ``cache_dir`` (``"default"``:
    :func:`default_cache_dir`; None: no cache), keyed on the spec, the
    package sources, the Numba, numba-cuda and ptxas versions (an entry
    without a listing is compiled again when ``sass`` asks for one).

    Raises
    ------
    FileNotFoundError
        When ``ptxas`` is None and :func:`find_tool` finds none.
    RuntimeError
        When a compiling subprocess fails outright.
    """
    ptxas = ptxas or find_tool("ptxas")
    if not ptxas:
        raise FileNotFoundError("ptxas not found: install the 'cuda' extra (nvidia-cuda-nvcc-cu12)")
    if sass and not disasm:
        disasm = find_tool("nvdisasm") or find_tool("cuobjdump")
    if not sass:
        disasm = None
    if cache_dir == "default":
        cache_dir = default_cache_dir()
    specs = list(specs)
    results, todo, paths = {}, [], {}
    for s in specs:
        job = s.job()
        if cache_dir:
            paths[s.key] = os.path.join(cache_dir, _cache_key(job, ptxas) + ".json")
            try:
                with open(paths[s.key]) as fh:
                    hit = json.load(fh)
                if not disasm or hit.get("sass"):  # a listing is compiled again only when asked for
                    results[s.key] = dict(hit, cached=True)
                    continue
            except (OSError, ValueError):
                pass
        todo.append(job)
    if todo:
        n = max(1, min(int(jobs or os.cpu_count() or 1), len(todo)))
        import linattn_nb

        root = os.path.dirname(os.path.dirname(os.path.abspath(linattn_nb.__file__)))
        env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0",
                   PYTHONPATH=os.pathsep.join([root] + [p for p in sys.path if p]))
        procs = []
        for w in range(n):
            req = json.dumps({"jobs": todo[w::n], "ptxas": ptxas, "disasm": disasm})
            p = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker"],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                 env=env)
            procs.append((p, req))
        outs = []
        for p, req in procs:
            p.stdin.write(req)
            p.stdin.close()
        for p, _ in procs:
            try:
                out = p.stdout.read()
                err = p.stderr.read()
                p.wait(timeout=timeout)
            finally:
                if p.poll() is None:
                    p.kill()
            outs.append((p.returncode, out, err))
        for rc, out, err in outs:
            got = [json.loads(ln[9:]) for ln in out.splitlines() if ln.startswith("@@RESULT ")]
            if rc != 0 and not got:
                raise RuntimeError(f"the compiling subprocess failed (exit {rc}):\n{err[-3000:]}")
            for r in got:
                results[r["key"]] = r
                if cache_dir and "error" not in r:
                    os.makedirs(cache_dir, exist_ok=True)
                    tmp = paths[r["key"]] + f".{os.getpid()}.tmp"
                    with open(tmp, "w") as fh:
                        json.dump(r, fh)
                    os.replace(tmp, paths[r["key"]])
    return results


def resources(result: dict) -> KernelResources:
    """The :class:`KernelResources` of one result of :func:`measure`."""
    return KernelResources(**result["resources"])


# ---------------------------------------------------------------------------
# The catalogue: every kernel at the configurations the launchers choose
# ---------------------------------------------------------------------------
_I, _B, _F64 = "int64", "boolean", "float64"


def _arr(dt: str, nd: int, layout: str = "C") -> str:
    return f"Array({dt}, {nd}, '{layout}')"


def sequence_launch(F: int, M: int, acc: str, rule: int, layout: str = "owner", code=None, off32: bool = True,
                    vec: int | None = None) -> dict:
    """The sequence kernel the launchers pick for ``F`` features, ``M`` values, accumulation dtype
    ``acc``, rule code ``rule`` and thread layout ``layout`` ("owner" where it applies, or "rows":
    :func:`linattn_nb.ops._cuda_launch.seq_layout`) and feature map ``code`` (None: the kernel for
    every map), with 32-bit element offsets within a sequence (``off32``, else 64-bit) and the
    vector-load bits ``vec`` (:func:`linattn_nb.ops.cuda.views.vector_bits`; None: those of
    contiguous, aligned inputs at this configuration): ``{"factory", "threads", "cfg", "vec"}``.

    Raises
    ------
    ValueError
        From ``seq_config`` when no configuration exists (a clean error at launch, not a failure).
    """
    from linattn_nb.ops.cuda import plan as KP

    itemsize = 4 if acc == "float32" else 8
    cfg = tuple(int(x) for x in KP.seq_config(F, M, itemsize, rule, layout))
    R, C, G, MB, T = cfg
    if vec is None:
        vec = (KP.VEC_QK if F % 4 == 0 else 0) | (KP.VEC_V if M % 4 == 0 and MB % 4 == 0 else 0)
    return {"factory": (*cfg, acc, int(rule), None if code is None else int(code), bool(off32), int(vec)),
            "threads": int(KP.threads_per_block(R, C, G, MB, rule)), "cfg": cfg, "vec": int(vec)}


def sequence_spec(F: int, M: int, acc: str, rule: int, in_dtype: str | None = None, key: str | None = None,
                  layout: str = "owner", code=None, off32: bool = True, vec: int | None = None,
                  lf_dtype: str = "float64") -> KernelSpec:
    """:class:`KernelSpec` of the sequence kernel at (``F``, ``M``, ``acc``, ``rule``, ``layout``), inputs
    of ``in_dtype`` (default ``acc``) as the launchers pass them
    (:func:`linattn_nb.ops.cuda.seq.seq_signature`: 1-d views and element strides, (n, F, M + 1)
    states in ``acc``, (B, N, W) log-factors of ``lf_dtype`` (float64; float32: a device ``log_decay``
    read in place), int64 / float64 / boolean scalars, the int32
    finiteness counters).  The key ends in ``/lf32`` for float32 log-factors,
    in ``/rows`` when ``layout`` "rows" replaces the owner layout,
    in ``/tiles`` when the tile layout applies (``layout="tiles"``; elsewhere it falls back to the owner layout),
    in ``/map<code>`` for a kernel specialised on feature map ``code`` (None: every map), in
    ``/off64`` for the kernel with 64-bit offsets (``off32=False``: sequences of 2^31 elements or
    more), and in ``/vec<bits>`` for vector-load bits other than those of contiguous inputs
    (:func:`sequence_launch`; ``vec=0``: strided or misaligned inputs, one element per load)."""
    from linattn_nb.ops.cuda import plan as KP, seq as KS
    from linattn_nb.ops._codes import rule_name

    if lf_dtype not in (_F64, "float32"):
        raise ValueError(f"lf_dtype must be 'float64' or 'float32' (the log-factors the launchers pass), "
                         f"got {lf_dtype!r}")
    launch = sequence_launch(F, M, acc, rule, layout, code, off32)
    if vec is not None and vec != launch["vec"]:
        launch = sequence_launch(F, M, acc, rule, layout, code, off32, vec)
        suffix = f"/vec{int(vec)}"
    else:
        suffix = ""
    dt = in_dtype or acc
    sig = tuple(repr(t) for t in KS.seq_signature(dt, acc, lf_dtype))  # Numba types' reprs evaluate back
    rows = layout == "rows" and KP.owner_fits(F, M, 4 if acc == "float32" else 8, rule)
    tiles = layout == "tiles" and KP.tiles_fits(F, M, 4 if acc == "float32" else 8, rule)
    key = key or (f"seq/{acc}/{rule_name(rule)}/F{F}/M{M}" + (f"/{dt}" if dt != acc else "")
                  + ("/rows" if rows else "") + ("/tiles" if tiles else "")
                  + ("" if code is None else f"/map{int(code)}")
                  + ("" if off32 else "/off64") + suffix + ("" if lf_dtype == _F64 else "/lf32"))
    return KernelSpec(key, "linattn_nb.ops.cuda.seq:seq_kernel", sig, launch["threads"],
                      factory=launch["factory"], group="sequence",
                      info={"F": F, "M": M, "acc": acc, "rule": int(rule), "rule_name": rule_name(rule),
                            "cfg": launch["cfg"], "in_dtype": dt,
                            "layout": "tiles" if tiles else "rows" if rows else "owner",
                            "off32": bool(off32), "vec": launch["vec"], "lf_dtype": lf_dtype})


def sequence_configurations(features, values, accs=("float32", "float64"), rules=None,
                            layouts=("owner", "rows", "tiles")) -> tuple[list, list]:
    """Every (F, M, acc, rule, layout) of the grid with the launch :func:`sequence_launch` gives it.

    Returns ``(launchable, refused)``: dicts with ``F, M, acc, rule, layout``
    and the launch (``cfg``, ``threads``), and those ``seq_config`` refuses
    (with the ValueError's message).  Every layout by default: the launchers
    take the tile layout (every rule, where it fits) or row groups where the owner
    layout applies when a GPU has few sequences per multiprocessor
    (:func:`linattn_nb.ops._cuda_launch.seq_layout`); "tiles" lists only the
    configurations it applies to (elsewhere it is the owner layout's).
    """
    from linattn_nb.ops.cuda import plan as KP
    from linattn_nb.ops._codes import RULES

    rules = [code for code, _ in RULES.values()] if rules is None else list(rules)
    ok, refused = [], []
    for layout in layouts:
        for acc in accs:
            for rule in rules:
                for F in features:
                    for M in values:
                        if layout == "tiles" and not KP.tiles_fits(F, M, 4 if acc == "float32" else 8, rule):
                            continue
                        try:
                            launch = sequence_launch(F, M, acc, rule, layout)
                        except ValueError as exc:
                            refused.append({"F": F, "M": M, "acc": acc, "rule": rule, "layout": layout,
                                            "error": str(exc)})
                            continue
                        ok.append({"F": F, "M": M, "acc": acc, "rule": rule, "layout": layout, **launch})
    return ok, refused


def helper_specs(accs=("float32", "float64")) -> list[KernelSpec]:
    """The helper kernels of :mod:`linattn_nb.ops.cuda.helpers` at their launch signatures, with
    ``config.CUDA_THREADS_PER_BLOCK`` threads (:func:`linattn_nb.ops.cuda.plan.helper_grid`)."""
    from linattn_nb import config

    tpb = int(config.CUDA_THREADS_PER_BLOCK)
    mod = "linattn_nb.ops.cuda.helpers:"
    H64, A2 = _arr(_F64, 3), _arr(_F64, 2)
    specs = [KernelSpec("helper/state_copy", mod + "state_copy_kernel", (H64, A2, H64, _B), tpb, group="helper"),
             KernelSpec("helper/chunk_factors", mod + "chunk_factors_kernel", (_arr(_F64, 3, "A"), _I, _I, A2), tpb,
                        group="helper"),
             KernelSpec("helper/chunk_factors/lf32", mod + "chunk_factors_kernel", (_arr("float32", 3, "A"), _I, _I,
                                                                                      A2), tpb, group="helper"),
             KernelSpec("helper/pack_column", mod + "pack_column_kernel", (_arr(_F64, 2, "A"), _arr(_F64, 3), _I),
                        tpb, group="helper"),
             KernelSpec("helper/pack_column/float32", mod + "pack_column_kernel",
                        (_arr("float32", 2, "A"), _arr(_F64, 3), _I), tpb, group="helper")]
    for acc in accs:
        H = _arr(acc, 3)
        specs.append(KernelSpec(f"helper/chunk_scan_states/{acc}", mod + "chunk_scan_states_kernel",
                                (H, H64, H, A2, _I, _B, _B, _I), tpb, group="helper"))
        if acc != _F64:
            specs.append(KernelSpec(f"helper/cast_copy/float64->{acc}", mod + "cast_copy_kernel", (H64, H), tpb,
                                    group="helper"))
            specs.append(KernelSpec(f"helper/cast_copy/{acc}->float64", mod + "cast_copy_kernel", (H, H64), tpb,
                                    group="helper"))
        a4 = _arr(acc, 4, "A")
        specs.append(KernelSpec(f"helper/copy4d/{acc}", mod + "copy4d_kernel", (a4, _arr(acc, 4, "A")), tpb,
                                group="helper"))
    return specs


def backward_specs(F: int = 64, M: int = 64, dtypes=("float32", "float64")) -> list[KernelSpec]:
    """The backward kernels of :mod:`linattn_nb.ops.grad._cuda_kernels` as
    :mod:`linattn_nb.ops.grad.cuda` launches them for ``F`` features and ``M`` values (``M + 1``
    state columns): the causal kernel with ``backward_threads(F, MB)`` threads, the helpers with
    ``config.CUDA_THREADS_PER_BLOCK``."""
    from linattn_nb import config
    from linattn_nb.ops.grad._cuda_kernels import backward_threads
    from linattn_nb.ops.grad.cuda import column_blocks

    tpb = int(config.CUDA_THREADS_PER_BLOCK)
    MB, _ = column_blocks(M + 1)
    C3, C4 = _arr(_F64, 3), _arr(_F64, 4)
    mod = "linattn_nb.ops.grad._cuda_kernels:"
    specs = []
    for dt in dtypes:
        w3 = _arr(dt, 3)
        sig = (w3, w3, w3, w3, C3, C3, _B, C3, C4, C4, C3, w3, C4, C4, C4, C4, _I, _I, _I)
        specs.append(KernelSpec(f"backward/causal/{dt}/F{F}/M{M}", mod + "causal_backward_kernel", sig,
                                backward_threads(F, MB), factory=(MB,), group="backward",
                                info={"F": F, "M": M, "MB": MB, "dtype": dt}))
        if dt == "float32":  # float32 log-factors (a device log_decay given in float32, viewed in place)
            sig32 = sig[:7] + (_arr("float32", 3),) + sig[8:]
            specs.append(KernelSpec(f"backward/causal/{dt}/F{F}/M{M}/lf32", mod + "causal_backward_kernel", sig32,
                                    backward_threads(F, MB), factory=(MB,), group="backward",
                                    info={"F": F, "M": M, "MB": MB, "dtype": dt}))
        specs.append(KernelSpec(f"backward/sum_blocks/{dt}", mod + "sum_blocks_kernel", (C4, w3), tpb,
                                group="backward"))
        specs.append(KernelSpec(f"backward/aggregate_sums/{dt}", mod + "aggregate_sums_kernel",
                                (w3, w3, w3, w3, C3, C3, _B, C3, C3), tpb, group="backward"))
        specs.append(KernelSpec(f"backward/aggregate_grads/{dt}", mod + "aggregate_grads_kernel",
                                (w3, w3, w3, C3, C3, w3, w3, w3), tpb, group="backward"))
    return specs


def step_specs(M: int = 64, dtypes=(("float32", "float16"), ("float32", "float32"), ("float64", "float32"),
                                    ("float64", "float64"))) -> list[KernelSpec]:
    """The decode-step kernels of :mod:`linattn_nb.ops.step.cuda` (the ``cuda.jit`` objects of its
    ``kernels()``) for (state dtype, input dtype) pairs, with ``config.CUDA_STEP_THREADS`` threads
    (the prefill kernels: ``min(CUDA_STEP_THREADS, max(32, M))``).  The signatures are the launch
    signatures of the state launchers: inputs, the double-buffered state (current, then the one a
    checked call writes), the output and scratch, the rule's float64 log-factors, the int32
    finiteness flag and the scalars."""
    from linattn_nb import config

    nt = int(config.CUDA_STEP_THREADS)
    npre = min(nt, max(32, int(M)))
    lg, fl = _arr(_F64, 3), _arr("int32", 1)
    specs = []
    for sdt, idt in dtypes:
        S3, z2, a3 = _arr(sdt, 3), _arr(sdt, 2), _arr(idt, 3)
        sigs = {
            "step": ((a3, a3, a3, S3, z2, S3, z2, a3, S3, lg, fl, _B, _I, sdt, _I, _I, _B, sdt, sdt), nt),
            "state_query": ((a3, S3, z2, a3, S3, fl, _B, _I, sdt, _I, sdt, sdt), nt),
            "prefill": ((a3, a3, S3, z2, S3, z2, lg, fl, _B, _I, _I, sdt, sdt), npre),
        }
        for name, (sig, threads) in sigs.items():
            specs.append(KernelSpec(f"step/{name}/{sdt}/{idt}", "linattn_nb.ops.step.cuda:kernels", sig, threads,
                                    factory=(), item=name, group="step", info={"state": sdt, "inputs": idt}))
    return specs


def dplr_specs(Fs=(64, 256), M: int = 64) -> list[KernelSpec]:
    """The DPLR scan kernel of :mod:`linattn_nb.ops.dplr.cuda` (``dplr_kernel(FMAX)``) for ``Fs``
    features, with the threads its launcher uses for ``M`` value columns (``launch_grid``).  Its
    state column is a local array of ``FMAX`` float64 values (stack, by design)."""
    from linattn_nb.ops.dplr.cuda import feature_capacity, launch_grid

    C3, C4 = _arr(_F64, 3), _arr(_F64, 4)
    sig = (C3, C3, C4, C4, C4, C4, C3, C3, C3, _arr("int32", 1), _I, _F64)
    _, threads = launch_grid(1, M)
    return [KernelSpec(f"dplr/scan/F{F}/M{M}", "linattn_nb.ops.dplr.cuda:dplr_kernel", sig, threads,
                       factory=(feature_capacity(F),), group="dplr", info={"F": F, "M": M})
            for F in Fs]


if __name__ == "__main__":  # the compiling subprocess of measure(): a JSON request on stdin
    if sys.argv[1:] != ["--worker"]:
        sys.exit(f"usage: {os.path.basename(sys.argv[0])} --worker  (run by measure(), a JSON request on stdin; "
                 "import this module to use it)")
    _worker()
