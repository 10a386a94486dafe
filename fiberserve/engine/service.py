"""LlmService: the engine.  It owns the model program, the fiber pool, the KV pages and the scheduler.

Requests flow: :meth:`LlmService.submit` validates and queues sequences; the engine's step runs in ``fibers``
lanes (:meth:`LlmService._lane`), each with at most one flight in the air::

    flight = await self._schedule()      # the scheduler's next batch, once there is work
    result = await self._run(flight)     # on an idle fiber: async with pool.acquire() as fiber: invoke
    self._land(flight, result)           # tokens recorded; their events held

and streaming overlaps the compute by the step's order: what a flight lands streams as the engine's next
flight takes off (its layers start), so the loop writes to the clients while a fiber computes.  A flight of
plain decodes may run several steps on its fiber, each landing as the next one takes off (``decode_steps``;
see the runner and the scheduler).  A flight's decodes may carry draft tokens, checked in the same pass
(``speculative_tokens``; see ``drafting.py``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import os
import random
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from fiberserve import kernels
from fiberserve.config import EngineConfig
from fiberserve.engine.adapters import AdapterNotFound, Adapters, lora_module
from fiberserve.engine.faults import FaultInjector
from fiberserve.engine.flight import Flight, FlightResult, Takeoffs
from fiberserve.engine.grammar import GrammarCompiler, GrammarState
from fiberserve.engine.kvcache import PagePool
from fiberserve.engine.runner import ModelRunner
from fiberserve.engine.sampling_params import InvalidParameter, SamplingParams
from fiberserve.engine.scheduler import Scheduler
from fiberserve.engine.sequence import FinishReason, Sequence, tokens
from fiberserve.engine.sequence_output import SequenceEvent, TokenLogprob
from fiberserve.model.assets import DEFAULT_MODEL_NAME, default_model_path
from fiberserve.model.batch import KVCache
from fiberserve.model.block_formats import NATIVE_BITS
from fiberserve.model.config import ModelConfig
from fiberserve.model.kv_format import kv_format
from fiberserve.model.llama import LlamaModel
from fiberserve.model.loader import Checkpoint, LoadStopped, load_checkpoint
from fiberserve.model.tokenizer import Tokenizer, load_tokenizer, read_chat_template, tokenizer_cache
from fiberserve.runtime import FiberPool, InvocationTimeout, Isolation, Program
from fiberserve.runtime.allocator import keep_freed_buffers, return_freed_buffers, trim_freed_memory
from fiberserve.runtime.cpu_share import ThreadTeams
from fiberserve.runtime.memory_lock import lock_in_memory, tensor_storages
from fiberserve.runtime.worker import hand_over_the_gil_promptly

log = logging.getLogger(__name__)

#: Seconds the engine stays idle before its heaps' freed memory goes back to the system.  While it serves, freed
#: buffers stay mapped for the next step (``runtime.allocator.keep_freed_buffers``); what they leave behind as the
#: flights' shapes change is returned once no flight has run for this long (as jemalloc's decay does), so an idle
#: server holds what it uses.
IDLE_TRIM_S = 2.0


class QueueFull(RuntimeError):
    """The admission queue is full; the caller should retry later (HTTP 503)."""


class RequestFailed(RuntimeError):
    """A request that gives one result (an embedding) ended without it: ``seq`` says how (abort or error)."""

    def __init__(self, request_id: str, seq: Sequence) -> None:
        super().__init__(f"request {request_id} failed: {seq.error or seq.finish_reason}")
        self.request_id, self.seq = request_id, seq


def resolve_dtype(name: str, device: str) -> torch.dtype:
    """``auto`` is bfloat16 where its products run fast: a GPU that computes bf16, or a CPU where the kernels'
    bf16 product was built (AVX512-BF16's ``vdpbf16ps``, or AVX2 multiply-adds with the same arithmetic, which
    read half the bytes of float32 weights); else float32."""
    if name in ("float32", "fp32"):
        return torch.float32
    if name in ("bfloat16", "bf16"):
        return torch.bfloat16
    if name != "auto":
        raise ValueError(f"--dtype must be float32, bfloat16 or auto, got {name!r}")
    if device.startswith("cuda"):
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
    kernels.load()
    return torch.bfloat16 if kernels.bf16_gemm_available() else torch.float32


#: The GGUF block formats whose files ``--quantization auto`` serves in int4: those served in their own blocks.
AUTO_INT4_TYPES = frozenset(NATIVE_BITS)


#: The largest bf16 copy of a model's decoder weights that ``--quantization auto`` makes on a CPU with AMX tiles:
#: below it the weights nearly stay in cache and the tiles' arithmetic wins; above it decode is bound by memory, and
#: the file's own blocks read a third of bf16's bytes (and add no copy).
AMX_BF16_MAX_BYTES = 512 << 20


def resolve_quantization(name: str, checkpoint: Checkpoint, device: str) -> str:
    """``auto`` is int4 where that mode serves the file's own weights (a GGUF whose decoder matrices are all in
    blocks int4 computes with as they are, as llama.cpp does: :data:`.NATIVE_BITS`) and is the faster mode: on a
    CPU whose bf16 products do not run on AMX tiles (there, int4's integer products win at every batch size), and
    on one whose do for a model whose bf16 decoder weights would exceed :data:`AMX_BF16_MAX_BYTES` (on the tiles
    bf16 wins from a few sequences on only while the weights are small).
    Otherwise none."""
    if name != "auto":
        return name
    if device != "cpu" or not checkpoint.decoder_weight_types or not checkpoint.decoder_weight_types <= AUTO_INT4_TYPES:
        return "none"
    kernels.load()
    bf16_bytes = 2 * checkpoint.config.decoder_weights
    return "none" if kernels.bf16_amx() and bf16_bytes <= AMX_BF16_MAX_BYTES else "int4"


#: What ``--kv-cache-mb`` unset gives at least (MiB), and the share of the memory available at start it takes at
#: most.
KV_CACHE_MIN_MB, KV_MEMORY_SHARE = 256, 0.25


def available_memory() -> int | None:
    """Bytes of memory available to new allocations (Linux's MemAvailable), or None where it is not known."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def kv_cache_pages(config: EngineConfig, page_bytes: int, max_context: int, available: int | None) -> tuple[int, str]:
    """The KV cache's pages and what bounds them: ``--kv-pages`` or ``--kv-cache-mb`` where given; else one sequence
    of ``max_context`` tokens, at least :data:`KV_CACHE_MIN_MB` and at most :data:`KV_MEMORY_SHARE` of the
    ``available`` memory (vLLM's ``VLLM_CPU_KVCACHE_SPACE`` and llama.cpp's ``-c`` are set by hand instead)."""
    if config.kv_pages:
        return config.kv_pages, "--kv-pages"
    if config.kv_cache_mb is not None:
        return max(2, int(config.kv_cache_mb * 2**20) // page_bytes), "--kv-cache-mb"
    context_pages = -(-max_context // config.page_size)
    least = KV_CACHE_MIN_MB * 2**20 // page_bytes
    if context_pages <= least:
        return max(2, least), f"its least size, {KV_CACHE_MIN_MB} MiB (the context needs less)"
    most = int(KV_MEMORY_SHARE * available) // page_bytes if available is not None else context_pages
    if context_pages <= most:
        return context_pages, "the model's context (one sequence of it)"
    share = f"{KV_MEMORY_SHARE:.0%} of the memory available at start ({(available or 0) / 2**30:.1f} GiB)"
    return max(2, least, most), share


def _check_satisfiable(seq: Sequence, params: SamplingParams) -> None:
    """Refuse, naming the grammar's field, a constraint no output can meet from its first token: a grammar that
    allows no first token, or only a stop token while ``min_new_tokens`` bans it, or that takes only the empty
    output while ``min_new_tokens`` asks for more.  (A dead end further on ends the sequence: see
    :func:`.sequence.append_token`.)"""
    grammar = seq.sampling.grammar
    assert grammar is not None and params.grammar is not None
    field, wanted = params.grammar.field, params.min_new_tokens
    only_empty = f"it takes only the empty output, but min_tokens asks for {tokens(wanted)}"
    if grammar.complete:
        if wanted > 0:
            raise InvalidParameter(field, only_empty)
        return
    if not grammar.allows_a_token():
        raise InvalidParameter(field, "no output satisfies it: the grammar allows no first token")
    if wanted > 0 and not grammar.allows_a_token(seq.sampling.stop_ids):
        raise InvalidParameter(field, only_empty)


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    #: None while the sequence runs.
    finish_reason: FinishReason | None
    matched_stop: str | int | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    error: str | None = None
    #: Per prompt position (None for the first), where the request asked for ``prompt_logprobs``.
    prompt_logprobs: list[TokenLogprob | None] | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    cached_tokens: int

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def completion_tokens(self) -> int:
        return sum(len(o.token_ids) for o in self.outputs)


@dataclass(eq=False)
class Request:
    id: str
    prompt_ids: list[int]
    seqs: list[Sequence]

    @property
    def adapter(self) -> str | None:
        """The name of the LoRA adapter the request runs under (None: the base model)."""
        adapter = self.seqs[0].adapter
        return None if adapter is None else adapter.name

    def output(self) -> RequestOutput:
        return RequestOutput(
            request_id=self.id,
            prompt_token_ids=self.prompt_ids,
            outputs=[completion_of(s) for s in self.seqs],
            cached_tokens=max(s.cached_tokens for s in self.seqs),
        )


def completion_of(seq: Sequence) -> CompletionOutput:
    return CompletionOutput(
        seq.index,
        seq.output.text,
        list(seq.output_ids),
        seq.finish_reason,
        seq.output.matched_stop,
        seq.output.logprobs,
        seq.error,
        seq.output.prompt_logprobs,
    )


@contextmanager
def _one_intra_op_thread() -> Iterator[None]:
    """Run torch work on the calling thread without an OpenMP thread team.

    The fibers' workers must own the only OpenMP teams in the process: libgomp
    stops spin-waiting between parallel regions once it manages more threads
    than there are cores, and the team a multi-threaded load leaves behind on
    the main thread would make every forward pass on a fiber much slower.
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _load_text_side(path: str, cache_dir: str | None, model_config: ModelConfig) -> tuple[Tokenizer, GrammarCompiler]:
    """The model's tokenizer and its grammar compiler, prepared (at start, not in the first constrained request)."""
    tokenizer = load_tokenizer(path, cache_dir, model_config.eos_token_ids)
    saved = tokenizer_cache(path, cache_dir)
    grammars = GrammarCompiler(tokenizer, model_config.vocab_size, saved and saved / "grammar-vocabulary.json")
    grammars.prepare()
    return tokenizer, grammars


class LlmService:
    """The serving engine; build with :meth:`load`, then ``await start()`` on the loop that serves."""

    def __init__(
        self,
        config: EngineConfig,
        model: LlamaModel,
        tokenizer: Tokenizer,
        model_path: str,
        grammars: GrammarCompiler | None = None,
    ) -> None:
        """``grammars``: the tokenizer's compiler, where :meth:`load` prepared it; else one built on first use."""
        self.config = config
        self.model = model
        self.tokenizer = tokenizer
        self.grammars = grammars or GrammarCompiler(tokenizer, model.config.vocab_size)
        self.model_path = model_path
        self.max_context = model.config.max_context
        if config.max_model_len is not None:
            if not 0 < config.max_model_len <= self.max_context:
                raise ValueError(
                    f"--max-model-len must be between 1 and the model's context length {self.max_context}, "
                    f"got {config.max_model_len}"
                )
            self.max_context = config.max_model_len
        kv_storage = kv_format(config.kv_cache_dtype, model.dtype)
        page_bytes = KVCache.bytes_per_page(model.config, config.page_size, kv_storage)
        num_pages, bound = kv_cache_pages(config, page_bytes, self.max_context, available_memory())
        log.info(
            "KV cache: %d tokens (%d pages, %.0f MiB, %s), bounded by %s; the context is %d tokens",
            num_pages * config.page_size,
            num_pages,
            num_pages * page_bytes / 2**20,
            str(kv_storage.storage).removeprefix("torch."),
            bound,
            self.max_context,
        )
        resident = KV_CACHE_MIN_MB * 2**20 // page_bytes  # the rest of a larger cache when first written
        self.kv_cache = KVCache(model.config, num_pages, config.page_size, kv_storage, model.device, resident)
        self.pages = PagePool(num_pages, config.page_size, config.prefix_caching)
        self.scheduler = Scheduler(
            self.pages, config.max_running, config.max_batch_tokens, config.decode_steps, config.speculative_tokens
        )
        self.adapters = Adapters(model.config, model.dtype, config.max_loras, config.max_lora_rank)
        self.faults = FaultInjector(config.fault_rate)
        #: Why the engine refuses work: an invariant that ``config.check_integrity`` found broken.
        self.broken: str | None = None
        #: Draws the sampling seeds of requests that give none (``config.seed`` seeds it).
        self.unseeded = random.Random(config.seed)
        threads = config.threads_per_fiber or max(1, (os.cpu_count() or 1) // config.fibers)
        self.teams = ThreadTeams(threads, config.fibers, config.fit_free_cores)
        self.program = Program(
            lambda fiber: ModelRunner(self.model, self.kv_cache, self.teams, self.faults),
            Isolation(config.isolation),
            name="llama-forward",
        )
        self.pool: FiberPool | None = None
        self._wake = asyncio.Event()  #: set when there may be work to board
        self._lanes: list[asyncio.Task] = []
        self._in_air: set[Flight] = set()
        self._closing = False
        self.flights_run = 0
        self.flights_failed = 0
        #: Whether the heaps' freed memory went back to the system with no flight since (``IDLE_TRIM_S`` idle).
        self.heap_trimmed = True
        self._trim_timer: asyncio.TimerHandle | None = None

    @classmethod
    def load(cls, config: EngineConfig, stop: threading.Event | None = None) -> LlmService:
        """Load weights and tokenizer (seconds for the default model); fetch the default if needed.  Once ``stop``
        is set, the load raises :class:`.LoadStopped` at its next layer (or after the weights)."""
        path = config.model or str(default_model_path(config.cache_dir, progress=config.progress))
        template = None if config.chat_template is None else read_chat_template(config.chat_template)
        return_freed_buffers()  # the load's temporaries leave nothing resident; serving keeps its buffers
        with _one_intra_op_thread(), ThreadPoolExecutor(1, thread_name_prefix="fiberserve-tokenizer") as side:
            checkpoint = load_checkpoint(path)  # first: a bad --model fails at once,
            dtype = resolve_dtype(config.dtype, config.device)  # not after the kernels' first build
            kv_format(config.kv_cache_dtype, dtype)  # nor a --kv-cache-dtype it cannot serve after the weights
            quantization = resolve_quantization(config.quantization, checkpoint, config.device)
            # The tokenizer and the grammar compiler's view of it are read on another core while the weights load.
            text = side.submit(_load_text_side, path, config.cache_dir, checkpoint.config)
            model = LlamaModel(checkpoint, dtype, config.device, quantization, progress=config.progress, stop=stop)
            if stop is not None and stop.is_set():
                raise LoadStopped("stopped after the weights")
            if config.mlock:
                locked = lock_in_memory(tensor_storages(model))
                log.info("--mlock: %.0f MiB of weights locked in memory", locked / 2**20)
            tokenizer, grammars = text.result()
            if template is not None:
                tokenizer.use_chat_template(template)
            service = cls(config, model, tokenizer, path, grammars)
            for name, adapter_path in map(lora_module, config.lora_modules):
                service.adapters.add(service.adapters.read(name, adapter_path), service.base_names)
                log.info("LoRA adapter %r served from %s", name, adapter_path)
        trim_freed_memory()
        keep_freed_buffers()
        return service

    @property
    def model_name(self) -> str:
        return DEFAULT_MODEL_NAME if self.config.model is None else Path(self.model_path).stem

    @property
    def base_names(self) -> frozenset[str]:
        """Names no adapter may take: the base model's."""
        return frozenset({self.model_name})

    # ------------------------------------------------------------------ LoRA adapters

    async def load_adapter(self, name: str, path: str, reserved: frozenset[str] = frozenset()) -> None:
        """Serve the adapter at ``path`` as ``name`` (read off the event loop); InvalidParameter naming
        ``lora_name`` or ``lora_path`` where it cannot be (``reserved``: more names taken, e.g. the server's)."""
        reserved = reserved | self.base_names
        self.adapters.check_new(name, reserved)
        adapter = await asyncio.to_thread(self.adapters.read, name, path)
        self.adapters.add(adapter, reserved)  # checked again: another load may have taken the name meanwhile

    def unload_adapter(self, name: str) -> None:
        """Stop serving adapter ``name``: :class:`.AdapterNotFound`, or :class:`.AdapterInUse` while an unfinished
        sequence runs under it.  Its cached prefix pages are never matched again and age out of the cache."""
        adapter = self.adapters.get(name)
        users = sum(seq.adapter is adapter for seq in itertools.chain(self.scheduler.waiting, self.scheduler.running))
        self.adapters.remove(name, users)

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Start the fibers and the lanes.  Sets the process's GIL switch interval
        (``runtime.worker.GIL_SWITCH_INTERVAL_S``), which an application embedding the engine shares."""
        hand_over_the_gil_promptly()
        self.pool = FiberPool(self.config.fibers, device=self.config.device, name="fiber")
        self._lanes = [
            asyncio.create_task(self._lane(), name=f"fiberserve-lane-{i}") for i in range(self.config.fibers)
        ]

    async def close(self) -> None:
        """Abort everything, let the flights in the air land, stop the lanes and the fibers."""
        self._closing = True
        for seq in [*self.scheduler.running, *self.scheduler.waiting]:
            self.scheduler.abort(seq)
        self._wake.set()
        await asyncio.gather(*self._lanes, return_exceptions=True)
        self.scheduler.release_events()
        if self._trim_timer is not None:
            self._trim_timer.cancel()
        if self.pool:
            self.pool.close()

    # ------------------------------------------------------------------ the engine's step

    async def _lane(self) -> None:
        """The engine's step, one flight at a time; ``config.fibers`` lanes run it (see the module docstring)."""
        while (flight := await self._schedule()) is not None:
            try:
                result = await self._run(flight)
                if result is not None:
                    self._land(flight, result)
            except Exception as exc:  # a defect of the engine's own: refuse new work rather than hang
                log.exception("the engine's step failed")
                self.broken = f"the engine's step failed: {exc!r}"
            finally:
                self._in_air.discard(flight)
                self._wake.set()  # another lane may board what this landing freed

    async def _schedule(self) -> Flight | None:
        """The next flight, once there is work; while there is none, what the last landing held streams and an
        idle engine is checked and trimmed.  None once the engine closes with nothing left to fly."""
        while (flight := self.scheduler.next_flight()) is None:
            self.scheduler.release_events()
            if self.is_idle():
                self._went_idle()
            if self._closing:
                return None
            self._wake.clear()
            await self._wake.wait()
        self._in_air.add(flight)
        self.heap_trimmed = False
        return flight

    async def _run(self, flight: Flight) -> FlightResult | None:
        """Run ``flight`` on an idle fiber.  As each of its steps takes off, the step before it lands (a
        multi-step flight) and what the engine's last landing held streams.  Returns the last step's result, or
        None where the flight failed (its sequences ended with the error)."""
        assert self.pool is not None, "flights fly once the service has started"
        flight.takeoffs = Takeoffs()
        try:
            async with self.pool.acquire() as fiber:
                call = asyncio.ensure_future(
                    self.program.invoke(fiber, flight, timeout=self.config.invocation_timeout)
                )  # queued on the fiber in its first step, before this coroutine waits
                try:
                    async for landed in flight.takeoffs.until(call):
                        if landed is not None:
                            self.scheduler.on_step(flight, landed)
                        self.scheduler.release_events()
                except asyncio.CancelledError:
                    call.cancel()  # the invocation holds the fiber until its call returns
                    await asyncio.gather(call, return_exceptions=True)
                    raise
                return await call
        except BaseException as exc:
            self.scheduler.release_events()  # held for this flight's takeoff, which its failure may have skipped
            self.flights_failed += 1
            log.warning("flight of %d sequences failed: %r", len(flight.items), exc)
            if isinstance(exc, InvocationTimeout):
                self._quarantine_until_returned(flight, exc)
            else:
                self.scheduler.on_flight_failed(flight, exc)
            if not isinstance(exc, Exception):
                raise
            return None

    def _land(self, flight: Flight, result: FlightResult) -> None:
        """Record the flight's tokens and end its finished sequences.  Their events are held until the engine's
        next flight takes off (or, with none to board, until :meth:`_schedule` finds none): the loop streams
        them while that flight computes, not while its worker prepares it."""
        self.flights_run += 1
        self.scheduler.hold_events()
        self.scheduler.on_flight_done(flight, result)

    def _went_idle(self) -> None:
        """With nothing running or waiting: check the invariants (``check_integrity``), and return the heaps'
        freed memory to the system ``IDLE_TRIM_S`` from now if the engine is idle still."""
        if self.config.check_integrity and self.broken is None:
            try:
                self.check_integrity()
            except AssertionError as exc:
                log.exception("the engine's invariants broke")
                self.broken = f"the engine's invariants broke: {exc}"
        if self.heap_trimmed:
            return
        loop = asyncio.get_running_loop()
        if self._trim_timer is not None:
            self._trim_timer.cancel()

        def trim() -> None:
            if self.is_idle():
                started = time.perf_counter()
                trim_freed_memory()
                self.heap_trimmed = True
                log.debug("heaps trimmed at idle in %.1f ms", (time.perf_counter() - started) * 1e3)

        self._trim_timer = loop.call_later(IDLE_TRIM_S, trim)

    def _quarantine_until_returned(self, flight: Flight, timeout: InvocationTimeout) -> None:
        """Fail a flight whose call ran past its deadline: the call may still write its sequences' K/V, so their
        pages stay in quarantine, and its thread team stays counted, until it returns (if it never does, they stay
        out of use, reported by ``/health`` and ``/metrics``)."""
        holder = timeout.fiber.name
        self.teams.hold(holder)
        self.scheduler.on_flight_failed(flight, timeout, quarantine=holder)
        held = self.pages.quarantined.get(holder, 0)
        log.warning("%d KV pages quarantined until the call on %s returns", held, holder)

        def returned(_: asyncio.Future) -> None:
            log.info("the call on %s returned: %d KV pages back", holder, self.pages.end_quarantine(holder))
            self.teams.release(holder)
            self._wake.set()

        timeout.call.add_done_callback(returned)

    # ------------------------------------------------------------------ requests

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise InvalidParameter for a request the engine cannot serve."""
        params.validate(self.config.max_n, self.model.config.vocab_size)
        if not prompt_ids:
            raise InvalidParameter("prompt", "is empty (at least one token is needed)")
        vocab = self.model.config.vocab_size
        if any(not 0 <= t < vocab for t in prompt_ids):
            raise InvalidParameter("input_ids", f"token ids must be in [0, {vocab})")
        total = len(prompt_ids) + params.max_new_tokens
        if total > self.max_context:
            raise InvalidParameter(
                "max_new_tokens",
                f"prompt ({len(prompt_ids)} tokens) plus max_new_tokens ({params.max_new_tokens}) "
                f"exceeds the context length {self.max_context}",
            )
        if self.pages.pages_for(total) > self.pages.num_pages:
            raise InvalidParameter(
                "max_new_tokens",
                f"prompt ({len(prompt_ids)} tokens) plus max_new_tokens ({params.max_new_tokens}) needs "
                f"{self.pages.pages_for(total)} KV pages; the KV cache holds {self.pages.num_pages} "
                f"({self.pages.num_pages * self.pages.page_size} tokens: raise --kv-cache-mb)",
            )

    def submit(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None, adapter: str | None = None
    ) -> Request:
        """Validate and queue a request, run under the LoRA adapter named ``adapter`` (None: the base model); its
        sequences start streaming events at once.  Raises RuntimeError once an integrity check has found the
        engine broken."""
        if self.broken is not None:
            raise RuntimeError(self.broken)
        lora = None
        if adapter is not None:
            try:
                lora = self.adapters.get(adapter)
            except AdapterNotFound:
                raise InvalidParameter("model", f"no LoRA adapter {adapter!r} is loaded") from None
        room = self.max_context - len(prompt_ids)
        if params.max_new_tokens_by_default and 0 < room < params.max_new_tokens:
            params = dataclasses.replace(params, max_new_tokens=room)
        self.validate(prompt_ids, params)
        grammar = self.grammars.compile(params.grammar) if params.grammar else None
        if len(self.scheduler.waiting) + params.n > self.config.max_queue:
            raise QueueFull(f"the admission queue is full ({self.config.max_queue} waiting)")
        rid = request_id or uuid.uuid4().hex
        seed = params.seed if params.seed is not None else self.unseeded.getrandbits(63)
        seqs = [
            Sequence(
                rid,
                i,
                prompt_ids,
                params,
                self.tokenizer.detokenizer(prompt_ids, params.skip_special_tokens),
                self.tokenizer.eos_token_ids,
                self.max_context,
                seed,
                lora,
            )
            for i in range(params.n)
        ]
        if grammar is not None:
            for seq in seqs:
                seq.sampling.grammar = GrammarState(grammar, seq.sampling.stop_ids)
            _check_satisfiable(seqs[0], params)
        for seq in seqs[1:]:
            seq.share_prompt_scores(seqs[0])
        for seq in seqs:
            computes = params.pooling is not None or (seq.scores_prompt and len(prompt_ids) > 1)
            if seq.max_tokens <= 0 and not computes:  # nothing to compute: "length" at once
                self.scheduler.finish(seq, FinishReason.LENGTH)
            elif (grammar := seq.sampling.grammar) is not None and grammar.complete:  # it takes only the empty output
                self.scheduler.finish(seq, FinishReason.STOP)
            else:
                self.scheduler.add(seq)
        self._wake.set()
        return Request(rid, list(prompt_ids), seqs)

    def abort(self, request: Request) -> None:
        for seq in request.seqs:
            self.scheduler.abort(seq)
        self._wake.set()

    @staticmethod
    async def events(seq: Sequence) -> AsyncIterator[SequenceEvent]:
        """The sequence's events up to and including the finished one, for its one consumer: :class:`.EventsTaken`
        if another reads them (a waiter, or a stream's merged queue)."""
        seq.take_events()
        queue = seq.output.events
        assert isinstance(queue, asyncio.Queue), "an unclaimed sequence's events are its own queue"
        while True:
            event = await queue.get()
            seq.output.events_read = event.finished
            yield event
            if event.finished:
                return

    async def wait(self, request: Request) -> RequestOutput:
        """Wait for every sequence of ``request``; aborts it if the waiter is cancelled.  A request already waited
        for to its end gives its output again; one that another consumer is still reading raises
        :class:`.EventsTaken`."""
        try:
            for seq in request.seqs:
                if seq.output.events_read:
                    continue
                async for _ in self.events(seq):
                    pass
        except asyncio.CancelledError:
            self.abort(request)
            raise
        return request.output()

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None, adapter: str | None = None
    ) -> RequestOutput:
        return await self.wait(self.submit(prompt_ids, params, request_id, adapter))

    async def embed(
        self, prompt_ids: list[int], pooling: str, request_id: str | None = None, adapter: str | None = None
    ) -> torch.Tensor:
        """The prompt's embedding: its final hidden states pooled (``last`` or ``mean``), float32 [hidden], not
        normalized; batched with the other requests like a prefill.  Raises InvalidParameter for a prompt the
        engine cannot take, :class:`RequestFailed` where it ends otherwise (an abort, an error)."""
        request = self.submit(prompt_ids, SamplingParams(max_new_tokens=0, pooling=pooling), request_id, adapter)
        await self.wait(request)
        seq = request.seqs[0]
        if seq.finish_reason is not FinishReason.STOP:
            raise RequestFailed(request.id, seq)
        return seq.output.pooled()

    async def flush_cache(self) -> int:
        return self.pages.flush()

    # ------------------------------------------------------------------ introspection

    def is_idle(self) -> bool:
        return not self.scheduler.running and not self.scheduler.waiting and not self._in_air

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()
        assert self._in_air or not self.scheduler.events_are_held, "events held with no flight to release them"
        if self.pool:
            self.pool.check_integrity()
