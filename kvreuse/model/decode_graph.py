"""The model's step compiled by torch.compile (inductor): decode batches (up to COMPILED_ROWS rows), without Python
overhead between the ~40 small ops of each of the model's layers.

What is compiled is `CausalLM.run_layers` itself, with attention behind one opaque op (`kvreuse::decode_attention`)
that reads the K/V pool and the step's attention metadata from a per-thread context. So the graph depends only on
the number of rows, not on context lengths or block tables (no recompiles as contexts grow), and the pool is written
in place (a pool passed into the graph would be copied by functionalization, once per layer). One graph per row
bucket (`row_buckets`: 1-16 and 17-64; 17-32 and 33-64 where the linears branch on the row count).

The graphs are built ahead of time, once per model, torch and CPU, by a child process at the lowest CPU priority
(graph_store.py; ~3 minutes on 2 cores, docs/bench/first-run; longer while the server is busy, as it yields them), and
loaded in a few seconds by every engine afterwards: the engine decodes eagerly until they are loaded, never slower for
them. A load still running when the engine closes or the interpreter exits is cancelled (`close`), and so is a build
(its process killed): a daemon thread left inside torch at exit is killed in a C++ frame that must not unwind, and the
process aborts ("terminate called without an active exception", exit 134). Without a C++ compiler (or on any error) the
graphs are abandoned with a warning and every step runs eagerly. The compiled step computes the eager step's bits, in
fp32 and bf16: the norms, RoPE, activations and Gemma's embedding scale are kvreuse's ops on both paths
(layers/pointwise.py), and so are the GGUF products with their casts; what inductor still fuses (the residual adds)
rounds once either way. Tested token and logprob for token and logprob (tests/test_decode_graph.py). Without the
extension (`KVREUSE_CPU_KERNELS=0`, CUDA) inductor fuses the torch ops, and in bf16 continuations can part
(docs/design/batch-invariance.md)."""

from __future__ import annotations

import atexit
import ctypes
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import types
import weakref
from collections.abc import Callable
from pathlib import Path

import torch

from kvreuse.background import lower_priority
from kvreuse.layers.attention import AttentionMetadata, store_and_attend
from kvreuse.model.decoder import CausalLM, ForwardKV
from kvreuse.model.graph_store import (
    Bucket,
    bucket_file,
    build_lock,
    graph_dir,
    graph_key,
    is_complete,
    load,
    mark_complete,
)

logger = logging.getLogger(__name__)


ROW_GRID = (16, 64)  # the top row count of each compiled graph (row_buckets)
BRANCHING_ROW_GRID = (16, 32, 64)  # the same for a model whose linears branch on the row count
COMPILED_ROWS = ROW_GRID[-1]  # decode steps of up to this many rows run compiled
BUILD_NICENESS = 19  # the build process's: Linux's weight at nice 19 is 1.5% of nice 0's
PR_SET_PDEATHSIG = 1
_current = threading.local()  # .value: the ForwardKV of the forward this thread runs
_compiling: weakref.WeakSet[DecodeGraph] = weakref.WeakSet()  # graphs whose compile thread may still run


class CompileCancelled(BaseException):
    """Raised inside the compile thread by `DecodeGraph.close`. A BaseException, so that no `except Exception` of
    torch's catches it on the way out."""


@atexit.register
def _cancel_at_exit() -> None:
    # atexit runs while daemon threads still run normally, before the interpreter starts killing them.
    for graph in list(_compiling):
        graph.close()


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_index: int, scale: float,
                     window: int) -> torch.Tensor:
    """`store_and_attend` for layer `layer_index` of the current thread's step (`window` 0: full attention). It
    writes the pool, which the compiler does not see: each layer's output feeds the next, so the calls keep their
    order."""
    kv: ForwardKV = _current.value
    return store_and_attend(q, k, v, *kv.caches[layer_index], kv.metas[layer_index], scale, window or None)


# Defined on a torch.library.Library rather than with torch.library.custom_op: the dispatcher then calls the
# function directly, 1.7 us a call against custom_op's 8 us (its autograd and aliasing checks), 30 calls a step.
_library = torch.library.Library("kvreuse", "DEF")  # the op lives as long as this object: the process
_library.define("decode_attention(Tensor q, Tensor k, Tensor v, int layer_index, float scale, int window) -> Tensor")
_library.impl("decode_attention", decode_attention, "CompositeExplicitAutograd")


@torch.library.register_fake("kvreuse::decode_attention")
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_index: int, scale: float,
      window: int) -> torch.Tensor:
    return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])


def _step(model: CausalLM, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    def attend(layer_index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        layer = model.layers[layer_index]
        return torch.ops.kvreuse.decode_attention(q, k, v, layer_index, layer.scale, layer.window or 0)

    return model.run_layers(input_ids, positions, None, attend)  # every row: the caller picks the ones it needs


def compiler_missing(device: torch.device) -> str | None:
    """Why inductor cannot compile for `device` here, or None."""
    if device.type == "cuda":
        try:
            import triton  # noqa: F401
        except ImportError:
            return "triton is not installed"
        return None
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler
        get_cpp_compiler()
    except Exception as exc:  # inductor raises its own types (and RuntimeError) for a missing or broken compiler
        return f"no C++ compiler for inductor ({exc})"
    return None


def _own_step() -> Callable:
    """`_step` under a code object of its own. dynamo keeps compiled graphs per code object, so without this every
    engine of a process (a benchmark's several) would add its graphs to one list and hit dynamo's recompile
    limit (8) by the fourth."""
    code = _step.__code__.replace()  # equal, but a distinct object
    return types.FunctionType(code, _step.__globals__, _step.__name__, _step.__defaults__, _step.__closure__)


def row_buckets(model: CausalLM, max_rows: int) -> list[tuple[int, int]]:
    """The row ranges compiled into one graph each (up to `max_rows`): 1-16, 17-64 (ROW_GRID), and for a model whose
    linears branch on the row count (`kernel_max_rows`: the GGUF kernel's limit, measured per CPU at 16 or 32; int8's
    32) 1-16, 17-32, 33-64, so that no graph straddles the branch. A range that a limit still falls inside is left out
    with every larger one: those steps run eagerly. One row shares its range's graph: a graph of its own (static
    shapes) rounded a row's norms otherwise than the 2-16-row graph, so a request's decode logprobs changed when it
    decoded alone (docs/design/batch-invariance.md). The grid is fixed per model, whatever the limit, because
    inductor's on-disk cache keys a graph without its range: a graph cached for 2-16 that is loaded for 2-64 brings in
    its `<= 16` guard, and the compile fails. Ranges that never overlap partially never meet such an entry; a budget
    under the first range compiles one-row steps alone."""
    limits = {m.kernel_max_rows for m in model.modules() if hasattr(m, "kernel_max_rows")}
    buckets, low = [], 1
    for high in BRANCHING_ROW_GRID if limits else ROW_GRID:
        if high > max_rows or any(low <= limit < high for limit in limits):
            break
        buckets.append((low, high))
        low = high + 1
    return buckets or [(1, 1)]


def scratch_step(model: CausalLM, bucket: Bucket) -> tuple[torch.Tensor, torch.Tensor, ForwardKV]:
    """Inputs of a step of `bucket`'s largest row count on a pool of its own (input_ids, positions: [T]), so that
    compiling or warming a graph touches nothing of an engine's; the row count is marked dynamic over the bucket."""
    low, high = bucket
    args, param = model.args, next(model.parameters())
    scratch = param.new_zeros(args.num_layers, 2, high, 1, args.num_kv_heads, args.head_dim)
    ids = torch.zeros(high, dtype=torch.long, device=param.device)              # [T]
    positions = torch.zeros_like(ids)                                           # [T]
    if high > low:
        for t in (ids, positions):
            torch._dynamo.mark_dynamic(t, 0, min=low, max=high)
    # A decode batch of `high` sequences of one token each (any meta runs the same graph).
    meta = AttentionMetadata.for_decode([1] * high, [[b] for b in range(high)], 1, param.device)
    return ids, positions, ForwardKV.uniform(scratch, meta)


def call_step(step: Callable, model: CausalLM, input_ids: torch.Tensor, positions: torch.Tensor,
              kv: ForwardKV) -> torch.Tensor:
    """`step(model, input_ids, positions)` with `kv` as the current thread's pool and metadata."""
    _current.value = kv
    try:
        return step(model, input_ids, positions)
    finally:
        _current.value = None


def compile_bucket(model: CausalLM, bucket: Bucket) -> Callable:
    """The step for `bucket`'s row counts, compiled ahead of time (torch's AOT precompile)."""
    ids, positions, kv = scratch_step(model, bucket)
    # Threads are read at run time (omp_get_max_threads), not fixed at compile time: the engine's count follows its
    # CPU share (engine/cpu_share.py).
    compiled = torch.compile(_own_step(), fullgraph=True, options={"cpp.dynamic_threads": True})
    return call_step(lambda *inputs: compiled.aot_compile((inputs, {})), model, ids, positions, kv)


@torch.inference_mode()
def build_graphs(model: CausalLM, buckets: list[Bucket], key: dict) -> Path:
    """Compile every bucket's step of `model` into the store's directory for `key` (the build process's work); a
    directory another process completed meanwhile is taken as it is."""
    directory = graph_dir(key)
    with build_lock(directory):
        if not is_complete(directory, key):
            for bucket in buckets:
                compile_bucket(model, bucket).save_compiled_function(str(bucket_file(directory, bucket)))
            mark_complete(directory, key)
    return directory


class DecodeGraph:
    """The compiled step of one model, for decode steps of up to `max_rows` rows (the runner keeps prompt rows eager:
    docs/design/batch-invariance.md). `start()` loads its graphs in a background
    thread, once a child process (`build_command`) has built them where they are not built yet; `can_run(num_rows)`
    says whether a step of that many rows runs compiled; `run(...)` gives the final hidden states of all its rows."""

    def __init__(self, model: CausalLM, max_rows: int, build_command: list[str] | None = None):
        """`build_command`: starts the process that builds the graphs (engine/precompile.py), given the key (JSON) as
        its last argument."""
        self.model, self.buckets = model, row_buckets(model, max_rows)
        self.max_rows = self.buckets[-1][1]  # there is always one, from 1 row
        self.key = graph_key(model, self.buckets)
        self.directory = graph_dir(self.key)
        self.build_command = build_command
        self.state = "eager"             # eager -> compiling -> compiled | failed | cancelled
        self.compile_s: float | None = None  # from start() to compiled: building (where it was not built) and loading
        self.error: str | None = None
        self.num_steps = 0               # steps run through the graph
        self._steps: list[Callable] = []  # each bucket's compiled step, once loaded
        self._process: subprocess.Popen | None = None  # the build process, while it runs
        self._closing = False
        self._done = threading.Event()   # the thread is over, or about to end without another bytecode
        self._lock = threading.Lock()    # orders a cancel against `_done` and the build process's start
        self._thread: threading.Thread | None = None

    @property
    def is_built(self) -> bool:
        return is_complete(self.directory, self.key)

    def can_start(self, build: bool) -> bool:
        """Whether `start(build)` has something to do: graphs to load, or to build first."""
        return self.state == "eager" and (self.is_built or (build and self.build_command is not None))

    def start(self, build: bool = True) -> None:
        """In a daemon thread, build the graphs in a child process at the lowest CPU priority unless they are built
        (`build`), then load them (the outcome is logged). The engine decodes eagerly until `state == "compiled"`.
        Where inductor has no compiler here, the state is "failed" at once, with the reason."""
        assert self.can_start(build), "nothing to load, and no build to start"
        # Here, not in the thread: asking inductor for its compiler imports it (~1 s of Python), which, in a thread
        # beside a served step, took the GIL from it (a first start's first answer took 2.7x its eager time).
        missing = compiler_missing(next(self.model.parameters()).device)
        if missing is not None:
            self._fail(missing)
            return
        self.state = "compiling"
        self._thread = threading.Thread(target=self._prepare_thread, name="kvreuse-decode-compile", daemon=True)
        _compiling.add(self)
        self._thread.start()

    def close(self, timeout: float = 60.0) -> bool:
        """Cancel a build or a load still running (state "cancelled") and wait for its thread; whether it ended within
        `timeout`. A build's process is killed; a load's cancel lands at the thread's next Python bytecode, after the
        C++ call it may be in (one kernel's g++ run, where inductor's cache lost it: seconds)."""
        thread = self._thread
        if thread is None:
            return True
        with self._lock:  # once `_done` is set the thread is past its last handler: nothing may land after it
            self._closing = True
            if self._process is not None and self._process.poll() is None:
                os.killpg(self._process.pid, signal.SIGKILL)
            if not self._done.is_set():
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident),
                                                           ctypes.py_object(CompileCancelled))
        thread.join(timeout)
        if thread.is_alive():
            logger.warning("the decode step's compile thread did not stop within %.0f s", timeout)
        return not thread.is_alive()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the thread ended (compiled, failed or cancelled, its outcome logged); whether it did within
        `timeout`."""
        return self._thread is None or self._done.wait(timeout)

    def can_run(self, num_rows: int) -> bool:
        return self.state == "compiled" and 1 <= num_rows <= self.max_rows

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, kv: ForwardKV) -> torch.Tensor:
        """The final hidden states [T, hidden] of every row of a step of T rows (input_ids, positions: [T])."""
        assert self.can_run(len(input_ids)), "not a step the compiled graphs run"
        self.num_steps += 1
        step = next(s for (_, high), s in zip(self.buckets, self._steps, strict=True) if len(input_ids) <= high)
        return call_step(step, self.model, input_ids, positions, kv)

    def _prepare_thread(self) -> None:
        try:
            try:
                self._prepare()
            except CompileCancelled:
                self.state, self.error = "cancelled", "the engine closed before the compile ended"
                logger.info("decode step compile cancelled: the engine closed")
            finally:
                with self._lock:
                    self._done.set()
        except CompileCancelled:  # the cancel landed after the compile ended, before `_done` was set
            self._done.set()

    def _prepare(self) -> None:
        start = time.perf_counter()
        lower_priority()  # this thread's share of the cores, and that of the g++ runs a load may need
        try:
            if not self.is_built:
                logger.info("decode step: eager while its graphs are built at the lowest CPU priority (a few "
                            "minutes on 2 cores, once per model; %s)", self.directory)
                self._build()
            steps = load(self.directory, self.buckets)
            with torch.inference_mode():  # each graph's first call (~0.1-0.5 s) here, not in a served step
                for bucket, step in zip(self.buckets, steps, strict=True):
                    call_step(step, self.model, *scratch_step(self.model, bucket))
            self._steps = steps
        except Exception as exc:  # a compiler error of any kind: the eager step serves instead
            self._fail(f"{type(exc).__name__}: {exc}")
        else:
            self.compile_s = time.perf_counter() - start
            self.state = "compiled"
            logger.info("decode step compiled: graphs loaded %.1f s after the start (steps of %s rows)", self.compile_s,
                        ", ".join(f"{low}" if low == high else f"{low}-{high}" for low, high in self.buckets))

    def _build(self) -> None:
        """Run the build process to its end; RuntimeError with the end of its output where it built nothing."""
        self.directory.mkdir(parents=True, exist_ok=True)
        log = self.directory / "build.log"
        with open(log, "wb") as output:
            with self._lock:
                if self._closing:
                    raise CompileCancelled
                self._process = subprocess.Popen([*self.build_command, json.dumps(self.key)], stdout=output,
                                                 stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                                 preexec_fn=_build_process_setup)
            code = self._process.wait()
        if not self.is_built:
            lines = log.read_text(errors="replace").strip().splitlines() or ["(no output)"]
            raise RuntimeError(f"the build process exited with {code}: {lines[-1][:500]} (all of it: {log})")

    def _fail(self, why: str) -> None:
        self.state, self.error = "failed", why
        logger.warning("decode step not compiled, decoding eagerly: %s", why.splitlines()[0][:500])


def _build_process_setup() -> None:
    """In the build process before it starts: a process group of its own (close() kills the compiler processes with
    it), the lowest CPU priority, and killed if the engine's process dies. Not a session of its own: Linux's
    autogroup gives each session an equal share of the CPU whatever its processes' nice values, which had the build
    take one of two cores from the server (64-token answers 15-30x slower while it ran; docs/bench/first-run/)."""
    os.setpgid(0, 0)
    os.setpriority(os.PRIO_PROCESS, 0, BUILD_NICENESS)
    if sys.platform == "linux":
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
