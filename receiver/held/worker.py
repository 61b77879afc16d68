"""A held ``Receiver`` inside one engine worker: the part of every engine adapter that is
not the engine's own.

An adapter (``receiver/vllm/backend.py``, ``receiver/sglang/loader.py``) owns one
``HeldWorker`` per worker process (a TP rank) and calls three methods from the engine's
own update window: ``start`` (ask the trainer for its names, map them onto the model by
probing its ``load_weights``, bootstrap to the trainer's version), ``update`` (commit every
staged version up to a target, in order, each all or nothing, then re-run the post-load
processing of the layers written) and ``shutdown``. Versions are received, validated and
staged in the background on a thread of the worker's own (``hold=True``) while the engine
generates; nothing is written outside ``update``.

What differs between engines is behind ``EngineSide``: the rules of its post-load
processing (``kinds.Rules``), its safe reload path, and its worker group (so every rank
lands on one version). Calls come from the engine's worker thread one at a time; a second
``start`` is refused, and ``update`` or ``shutdown`` before ``start`` raise ``StateError``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import random
import socket
import threading
import time
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import torch

from protocol.errors import ConfigError, MetadataMismatchError, StateError, WeightSyncError, WeightSyncTimeout
from protocol.net.security import CurveClient, KeyPair, z85_key
from protocol.quant import Fp8Format
from protocol.state import Placed
from protocol.wire.framing import MessageType
from protocol.wire.metadata import ModelMetadata

from ..apply.commit import StagedUpdate
from ..apply.readback import check_all
from ..control.service import Receiver
from ..describe import ask_metadata
from ..engine import parse_version
from ..naming import AGENT_PREFIX
from ..strategy.base import PendingVersion, StrategyHooks
from .fp8 import declare_fp8, with_fp8, with_scales
from .kinds import How, Rules
from .layout import Backup, Layout, Prepack, derive_layout
from .steps import StepVersions

log = logging.getLogger(__name__)
T = TypeVar("T")
# Elements read back per tensor after each commit (HeldInit.check_writes):
# benchmarks/vllm_hold.py measures what it adds to the hold (docs/performance.md).
CHECK_WRITES = 8


class EngineSide(Protocol):
    """What a ``HeldWorker`` needs of the engine it runs in: one small class per engine."""

    name: str  # "vllm", "sglang": logs, and the receiver's identity at the trainer
    rules: Rules  # what the engine's post-load processing is known to do (kinds.py)

    def reload(self, model: torch.nn.Module, weights: Mapping[str, torch.Tensor]) -> None:
        """Load these whole checkpoint tensors through the engine's own path, post-load
        processing included (the layers the map does not understand)."""

    def world(self) -> int:
        """Workers holding one copy of the model between them (tensor/pipeline ranks)."""

    def rank(self) -> int:
        """This worker's rank among them."""

    def broadcast(self, value: Any) -> Any:
        """``value`` of rank 0, on every rank (a collective: every rank calls it)."""

    def gather(self, value: Any) -> list[Any]:
        """Every rank's ``value``, in rank order, on every rank (a collective)."""

    # Optional: ``quant() -> protocol.quant.Fp8Format | None``, the model's block-fp8 format (vLLM's
    # checkpoint quantization_config); an engine side without it holds no fp8 weights.

    def step_module(self, model: torch.nn.Module) -> torch.nn.Module:
        """The module the engine calls once per step through ``__call__`` (its forward
        pre-hook counts the steps, ``steps.py``): an engine that calls the model's
        ``forward`` directly bypasses hooks on the model itself."""


class Targets(Protocol):
    """What a worker writes into when it is not the model's base weights (vLLM's LoRA
    slots, ``receiver/vllm/lora.py``): its own layout, told of each commit."""

    layout: Layout

    def commit(self, names: set[str]) -> None: ...

    def check(self, writes: list[tuple[str, StagedUpdate]], elements: int, rng: random.Random) -> int: ...

    def close(self) -> None: ...


@dataclass
class HeldInit:
    """How a worker reaches its trainer, as every engine's init call takes it.

    ``endpoint``: the trainer's ``Sender`` (or a list tried in turn: relays, failover).
    ``config``: the sync YAML's content as a dict, or its path. ``curve``: ``{"public",
    "secret", "server_key"}`` (Z85) for CURVE beyond loopback. ``name_mapping``: this
    engine's checkpoint name -> the trainer's name (a dict), or ``"is_agent"``.
    ``timeout``: seconds for the handshake and bootstrap. ``prepack``: where the engine
    re-packs layers after loading (vLLM on CPU), re-pack them while a version is staged, on
    copies, so that the update only swaps them in (one more copy of those layers' weights).
    ``check_writes``: after each commit, read back this many of the elements written into
    each tensor and compare them with the staged values (``receiver.apply.readback``); a map
    that wrote elsewhere fails the update with ``WriteCheckError`` instead of serving. 0: off."""

    endpoint: str | list[str]
    config: dict[str, Any] | str | None = None
    curve: dict[str, str] | None = None
    name_mapping: dict[str, str] | str | None = None
    timeout: float = 120.0
    insecure_plaintext: bool = False
    prepack: bool = True
    check_writes: int = CHECK_WRITES

    def __post_init__(self) -> None:
        endpoints = [self.endpoint] if isinstance(self.endpoint, str) else self.endpoint
        if not isinstance(endpoints, list) or not endpoints or not all(isinstance(e, str) and e for e in endpoints):
            raise ConfigError(f"init_info.endpoint must be an address or a non-empty list of them, got {self.endpoint!r}")
        if self.config is not None and not isinstance(self.config, dict | str):
            raise ConfigError(f"init_info.config must be a dict or a path, got {type(self.config).__name__}")
        if self.curve is not None and (not isinstance(self.curve, dict) or set(self.curve) != {"public", "secret", "server_key"}):
            raise ConfigError("init_info.curve must have exactly the keys public, secret and server_key")
        if self.name_mapping is not None and not (isinstance(self.name_mapping, dict) or self.name_mapping == "is_agent"):
            raise ConfigError("init_info.name_mapping must be a dict (checkpoint name -> trainer name) or 'is_agent'")
        if isinstance(self.timeout, bool) or not isinstance(self.timeout, int | float) or self.timeout <= 0:
            raise ConfigError(f"init_info.timeout must be a positive number of seconds, got {self.timeout!r}")
        if type(self.prepack) is not bool:
            raise ConfigError(f"init_info.prepack must be true or false, got {self.prepack!r}")
        if type(self.check_writes) is not int or self.check_writes < 0:
            raise ConfigError(f"init_info.check_writes must be an int >= 0 (elements a tensor; 0: off), got {self.check_writes!r}")

    @property
    def endpoints(self) -> list[str]:
        return [self.endpoint] if isinstance(self.endpoint, str) else list(self.endpoint)

    def curve_client(self) -> CurveClient | None:
        if self.curve is None:
            return None
        keys = KeyPair(z85_key(self.curve["public"], "curve.public"), z85_key(self.curve["secret"], "curve.secret"))
        return CurveClient(keys, z85_key(self.curve["server_key"], "curve.server_key"))


def check_update(version: Any, timeout: Any, verify_checksum: Any) -> None:
    """An update call's arguments, refused with ``ConfigError`` before anything runs."""
    parse_version(version)  # a ConfigError (a ValueError too) unless it names a version
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout <= 0):
        raise ConfigError(f"update_info.timeout must be a positive number of seconds or null, got {timeout!r}")
    if type(verify_checksum) is not bool:
        raise ConfigError(f"update_info.verify_checksum must be true or false, got {verify_checksum!r}")


@dataclass
class _Ahead:
    pending: PendingVersion  # the staged version the layers were re-packed for
    prepack: Prepack


class LoopThread:
    """An event loop on its own daemon thread: the worker's thread hands it coroutines."""

    def __init__(self, name: str) -> None:
        self.loop: asyncio.AbstractEventLoop
        try:
            import uvloop

            self.loop = uvloop.new_event_loop()
        except ImportError:
            self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None, what: str = "") -> T:
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:  # not the builtin TimeoutError before Python 3.11
            future.cancel()
            raise WeightSyncTimeout(f"weightsync: {what or 'the call'} did not finish within {timeout:.3g}s") from None

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        if not self.thread.is_alive():
            self.loop.close()


class HeldWorker:
    """One engine worker's held receiver, over its model as ``derive_layout`` maps it (see
    the module doc)."""

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype, side: EngineSide) -> None:
        if not isinstance(dtype, torch.dtype):
            raise ConfigError(f"the engine's model dtype is {dtype!r}, not a torch dtype")
        self.model, self.dtype, self.side = model, dtype, side
        quant = getattr(side, "quant", None)  # an engine side may say its model is block fp8 (EngineSide.quant)
        self.quant: Fp8Format | None = quant() if quant is not None else None
        if quant is None and any(p.is_floating_point() and p.element_size() == 1 for p in model.parameters()):
            # an engine whose side cannot say its fp8 format (SGLang's, today): never written by a guess
            raise ConfigError(
                f"this {type(side).__name__} engine holds float8 parameters, and its side cannot say their block-fp8 format "
                "(EngineSide.quant): fp8 engines are followed on vLLM; load this engine in bf16"
            )
        self.receiver: Receiver | None = None
        self.layout: Layout | None = None
        self.targets: Targets | None = None  # where the writes go instead of the base weights (vLLM's LoRA slots)
        self._thread: LoopThread | None = None
        self._stale: dict[torch.nn.Module, None] = {}  # layers written since their last re-pack (ordered)
        self._keys: tuple[str, ...] = ()  # the trainer's names, in the receiver's ordinal order
        self._names: dict[str, str] = {}  # trainer name -> this engine's checkpoint name
        self.last_timing: dict[str, float] = {}  # the last update: commit and re-pack seconds (benchmarks/vllm_hold.py)
        self.prepack = False
        self.totals = {"updates": 0, "layers_installed": 0, "layers_repacked": 0, "layers_reloaded": 0, "layers_shadowed": 0}  # since init
        # The staged version's layers, re-packed ahead on copies; installed inside its commit.
        self._ahead: _Ahead | None = None
        self._installed = 0  # layers installed by the commits of the update in progress
        self.last_prepack_s = 0.0  # the last version's re-pack ahead, off the hold
        self.check_writes = 0
        self._checked = (0.0, 0)  # reading back the update in progress's writes: seconds (of its commit), tensors
        self._check_rng = random.Random()
        self.step_versions: StepVersions | None = None  # which version each engine step ran with (steps.py)
        self._step_hook: torch.utils.hooks.RemovableHandle | None = None

    # -- the engine's window ----------------------------------------------------------------
    def start(self, init: HeldInit, targets: Callable[[list[tuple[str, tuple[int, ...]]]], Targets] | None = None) -> None:
        """Map the trainer's tensors onto the model (or onto ``targets(shapes)``), start the
        receiver and bootstrap to the trainer's version; returns once this worker holds it.
        A failure leaves nothing running and the model's weights as they were (a host copy
        of them is held for the length of the start)."""
        if self.receiver is not None:
            raise StateError("the weightsync engine is already initialised; shut it down first")
        started = time.perf_counter()
        thread = self._thread = LoopThread(f"weightsync-{self.side.name}-{self._rank()}")
        backup = Backup(self.model) if targets is None else None  # what it served before: back if the start fails
        try:
            curve = init.curve_client()
            failed: Exception | None = None
            order: list[str] = []  # the checkpoint names the receiver holds, in its ordinal order
            try:
                trainer = thread.run(
                    ask_metadata(init.endpoints, curve=curve, insecure_plaintext=init.insecure_plaintext, timeout=init.timeout),
                    init.timeout + 5, "asking the trainer for its checkpoint names",
                )
                names = checkpoint_names(trainer, init.name_mapping)
                if targets is not None:  # refused before any write
                    self.targets = targets([(names[k], tuple(shape)) for k, shape in zip(trainer.keys, trainer.shapes)])
                    self.layout = self.targets.layout
                else:  # every float tensor is declared in the engine's dtype: what its weights are in
                    declared = [(names[k], tuple(shape), self.dtype if d.is_floating_point else d)
                                for k, shape, d in zip(trainer.keys, trainer.shapes, trainer.dtypes)]
                    if self.quant is not None:  # but those it holds in block fp8, with their scales
                        declared = declare_fp8(self.model, declared, self.quant, self.side.rules)
                        names = with_scales(names, [name for name, _, _ in declared])
                    self.layout = derive_layout(self.model, declared, self.side.rules)
                    order = [name for name, _, _ in declared]
            except Exception as e:  # every rank still takes part in the check below: none is left waiting in it
                failed = e
            if targets is None:
                self._check_coverage(self.layout, failed)
            elif failed is not None:
                raise failed
            assert self.layout is not None
            layout = self.layout
            if targets is not None:
                order = [names[k] for k in trainer.keys]
            trainer_name = {c: k for k, c in names.items()}
            state = {trainer_name[c]: layout.tensors[c] for c in order}  # under the trainer's names, in the declared order
            self._keys, self._names = tuple(state), names
            self.check_writes = init.check_writes
            self.prepack = init.prepack and bool(layout.shadows)
            # layers the engine re-packs into kernel copies (vLLM on CPU): only those can be re-packed ahead
            self.totals["layers_shadowed"] = len(layout.shadows)
            receiver = Receiver(
                state, init.endpoints, with_fp8(init.config, self.quant), hold=True, identity=self._identity(),
                curve=curve, insecure_plaintext=init.insecure_plaintext,
                hooks=StrategyHooks(on_commit=(self._committed,), on_staged=self._prepack if layout.shadows else None),
            )
            self.receiver = receiver
            self.step_versions = StepVersions(lambda: receiver.version)
            self._step_hook = self.side.step_module(self.model).register_forward_pre_hook(self.step_versions.forward)
            self._log_kinds(layout)
            thread.run(receiver.start(init.timeout), init.timeout + 5, "the handshake and bootstrap")
            layers = layout.repack(layout.layers_of(names.values()))
            self._reload(layout.reloads.mirrors)
            self._stale.clear()
        except BaseException:
            self.shutdown()
            if self.layout is not None and self.targets is None:
                self.layout.unshadow()
            if backup is not None:
                backup.restore()
            self.layout = None
            raise
        log.info(
            "weightsync: %s worker %s at v%s after %.2fs (%d tensors, %d placed elsewhere, %d layers re-packed)",
            self.side.name, self._rank(), receiver.version, time.perf_counter() - started, len(state), len(layout.unmapped), layers,
        )

    def _check_coverage(self, layout: Layout | None, failed: Exception | None) -> None:
        """Every rank's map, compared (a collective): a rank that could not map raises on every
        rank, and so does a parameter no trainer tensor reaches while some trainer tensor
        lands on no rank at all (names the engine's loader skipped: it would serve whatever
        it holds now through every version). A parameter of one rank alone unreached is a
        tensor-parallel rank's padding; a trainer tensor landing nowhere while every
        parameter is reached is one the engine does not use (said, and dropped)."""
        mine = (None if failed is None else f"{type(failed).__name__}: {failed}",
                [] if layout is None else layout.unmapped, [] if layout is None else layout.untouched)
        every = self.side.gather(mine) if self.side.world() > 1 else [mine]
        if failed is not None:
            raise failed
        errors = {rank: error for rank, (error, _, _) in enumerate(every) if error is not None}
        if errors:
            raise MetadataMismatchError(f"weightsync: worker(s) {sorted(errors)} could not map the trainer's tensors: {errors}")
        nowhere = sorted(set.intersection(*(set(unmapped) for _, unmapped, _ in every)))
        untouched = {rank: names for rank, (_, _, names) in enumerate(every) if names}
        if nowhere and untouched:
            raise MetadataMismatchError(
                f"the engine's parameters {dict(list(untouched.items())[:2])} (by rank) are reached by none of the trainer's "
                f"tensors, and the trainer's {nowhere[:4]} land nowhere: send them as this engine's load_weights names them "
                "(name_mapping, or the checkpoint's own names)"
            )
        if nowhere:
            log.warning("weightsync: the engine loads none of the trainer's %s: they are received and dropped", nowhere[:8])

    def update(self, target: int | None, timeout: float | None, verify_checksum: bool = False) -> None:
        """Commit every staged version up to ``target`` (None: the sender's current one), in
        order, each all or nothing; every worker of the engine ends at one version, ``target``
        or later (a resync may land past it). Then the layers written are re-processed.
        A failure raises and leaves the weights at the last fully applied version."""
        receiver, thread = self.healthy(), self._thread
        assert thread is not None and self.layout is not None
        started = time.perf_counter()
        target = self._agree_on_target(target, timeout)
        limit = None if timeout is None else timeout + 5
        for _ in range(3):  # workers may land on different versions (a resync past the target): even them out
            failed: Exception | None = None
            if receiver.version is None or target is None or receiver.version < target:
                try:
                    thread.run(receiver.update_weights(target, False, timeout), limit, f"update_weights to v{target}")
                except Exception as e:  # every rank still takes part in the gather: none is left waiting in it
                    failed = e
            outcome = (receiver.version, None if failed is None else f"{type(failed).__name__}: {failed}")
            outcomes = self.side.gather(outcome) if self.side.world() > 1 else [outcome]
            if failed is not None:
                raise failed
            errors = {rank: error for rank, (_, error) in enumerate(outcomes) if error is not None}
            if errors:
                raise WeightSyncError(f"weightsync: worker(s) {sorted(errors)} failed the update ({errors}); "
                                      f"the workers hold {[v for v, _ in outcomes]}, the next update evens them out")
            versions = [v for v, _ in outcomes]
            if len(set(versions)) == 1:
                break
            target = max(v for v in versions if v is not None)
        else:
            raise WeightSyncError(f"the workers did not converge on one version: {versions}")
        committed = time.perf_counter()
        stale, self._stale = list(self._stale), {}
        installed, self._installed = self._installed, 0
        layers = self.layout.repack(stale)
        (checked_s, checked), self._checked = self._checked, (0.0, 0)
        self.last_timing = {"commit_s": committed - started, "repack_s": time.perf_counter() - committed,
                            "check_s": checked_s, "checked_tensors": checked, "layers_installed": installed, "layers_repacked": layers,
                            "layers_shadowed": len(self.layout.shadows)}
        self.totals["updates"] += 1
        self.totals["layers_installed"] += installed
        self.totals["layers_repacked"] += layers
        if verify_checksum:
            thread.run(receiver.update_weights(receiver.version, True, timeout), limit, "verify_checksum")

    def shutdown(self) -> None:
        """Stop the receiver and its thread; the weights stay as they are. Idempotent."""
        receiver, thread = self.receiver, self._thread
        self.receiver = self._thread = None
        if self._step_hook is not None:  # step_versions stays readable: what ran, up to here
            self._step_hook.remove()
            self._step_hook = None
        if self.targets is not None:
            self.targets.close()
            self.targets = None
        if thread is None:
            return
        try:
            if receiver is not None:
                thread.run(receiver.close(), 15)
        finally:
            thread.stop()

    def healthy(self) -> Receiver:
        """The receiver, or a typed error: never started (``StateError``) or stopped."""
        if self.receiver is None:
            raise StateError("the weightsync engine is not initialised: call its init first (vLLM: init_weight_transfer_engine)")
        if not self.receiver.healthy:
            raise WeightSyncError(f"the weightsync receiver has stopped: {self.receiver.status()['error']}")
        return self.receiver

    @property
    def version(self) -> int | None:
        """The version this worker holds (None before ``start``)."""
        return None if self.receiver is None else self.receiver.version

    # -- internals ----------------------------------------------------------------------
    def _committed(self, pending: PendingVersion) -> None:
        """Inside the commit (the worker waits in ``update``, the engine runs nothing): swap
        in the layers re-packed ahead for this version, and note the others it wrote."""
        assert self.layout is not None
        ahead, self._ahead = self._ahead, None
        installed: set[torch.nn.Module] = set()
        if ahead is not None and ahead.pending is pending:
            for layer in ahead.prepack.layers:
                self.layout.install(ahead.prepack, layer)
            installed = set(ahead.prepack.layers)
            self._installed += len(installed)
        writes = self._writes(pending)
        names = {name for name, _ in writes}
        self._reload(self.layout.reloads.weights_for(names))
        seconds, count = self._check(writes, self.layout.tensors)
        if self.targets is not None:  # e.g. registers an adapter the engine lacks; reads back its own
            self.targets.commit(names)
            started = time.perf_counter()
            count += self.targets.check(writes, self.check_writes, self._check_rng)
            seconds += time.perf_counter() - started
        self._checked = (self._checked[0] + seconds, self._checked[1] + count)
        for layer in self.layout.layers_of(names):
            if layer not in installed:
                self._stale[layer] = None
            else:
                self._stale.pop(layer, None)

    def _reload(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Hand the whole tensors of the layers the map does not understand (``kinds.py``)
        to the engine's own reload; inside the commit, so a failure leaves the version unpublished."""
        if not weights:
            return
        assert self.layout is not None
        self.side.reload(self.model, weights)
        self.totals["layers_reloaded"] += len(self.layout.layers_of(weights))

    def _log_kinds(self, layout: Layout) -> None:
        """Once per layer kind the map does not write element by element: which, and why."""
        seen: dict[str, tuple[int, str]] = {}
        for kind in layout.kinds.values():
            if kind.how is not How.MAPPED:
                count, reason = seen.get(kind.name, (0, kind.reason))
                seen[kind.name] = (count + 1, reason)
        for name, (count, reason) in seen.items():
            how = next(k.how for k in layout.kinds.values() if k.name == name)
            if how is How.RELOAD:
                log.warning("weightsync: %d %s layers are not mapped (%s): each version that changes them reloads their "
                            "whole tensors through %s's load_weights", count, name, reason, self.side.name)
            else:
                log.info("weightsync: %d %s layers are mapped through their post-load permutation", count, name)

    def _check(self, writes: Sequence[tuple[str, StagedUpdate]], targets: Mapping[str, Any]) -> tuple[float, int]:
        """Read back a sample of each mapped tensor ``writes`` wrote into ``targets``;
        returns the seconds it took and how many tensors it read. Only mapped tensors
        (``Placed``) are read: a plain target is one view of one parameter, proven by the
        map's probes, and written by the receiver's own paths."""
        if not self.check_writes:
            return 0.0, 0
        started = time.perf_counter()
        checks = [(name, target, update) for name, update in writes if isinstance(target := targets.get(name), Placed)]
        check_all(checks, self.check_writes, self._check_rng)  # two reads of the device for all of them
        return time.perf_counter() - started, len(checks)

    def _writes(self, pending: PendingVersion) -> list[tuple[str, StagedUpdate]]:
        """(checkpoint name, update) of every tensor a version writes: each update's own,
        and its untied aliases' (one update, several names)."""
        receiver = self.receiver
        assert receiver is not None
        aliases = receiver.strategy.aliases
        return [(self._names[self._keys[o]], u) for u in pending.updates for o in (u.ordinal, *aliases.get(u.ordinal, ()))]

    async def _prepack(self, pending: PendingVersion) -> None:
        """Once a patch is staged (before it can be committed): re-pack the layers it
        touches on copies, while the engine generates, and drop the updates those copies
        hold entirely from what the commit writes. A failure only costs the hold: those
        layers re-pack inside ``update``. Off (``prepack`` False): nothing."""
        self._ahead = None
        if not self.prepack or pending.type is not MessageType.PATCH:
            return  # a resync re-packs every layer inside update
        layout = self.layout
        assert layout is not None
        writes = self._writes(pending)
        started = time.perf_counter()
        try:
            prepack = await asyncio.to_thread(layout.prepack, layout.layers_of(dict.fromkeys(name for name, _ in writes)), writes)
            # What the copies hold entirely is not written again in the hold: read it back here.
            ahead = [(name, u) for name, u in writes if layout.holds(prepack, name)]
            await asyncio.to_thread(self._check, ahead, prepack.targets)
        except Exception as e:  # logged; update re-packs (and reads back) these layers inline
            log.warning("weightsync: re-packing v%s ahead failed, it will re-pack inside the update: %s", pending.version, e)
            return
        partly = {id(u) for name, u in writes if not layout.holds(prepack, name)}  # some name of it is not in the copies
        pending.updates[:] = [u for u in pending.updates if id(u) in partly]
        self._ahead = _Ahead(pending, prepack)
        self.last_prepack_s = time.perf_counter() - started

    def _agree_on_target(self, target: int | None, timeout: float | None) -> int | None:
        """One version for every worker: "the sender's current one" is asked once."""
        if target is None and self.side.world() > 1:
            receiver, thread = self.healthy(), self._thread
            assert thread is not None
            if self.side.rank() == 0:
                target = thread.run(receiver.sender_version(timeout), timeout, "asking the sender's version")
            target = self.side.broadcast(target)
        return target

    def _rank(self) -> int:
        return self.side.rank() if self.side.world() > 1 else 0

    def _identity(self) -> str:
        return f"{self.side.name}-{socket.gethostname()}-{os.getpid()}-rank{self._rank()}"


def checkpoint_names(trainer: ModelMetadata, mapping: dict[str, str] | str | None) -> dict[str, str]:
    """Trainer name -> the checkpoint name the engine's load_weights takes."""
    if mapping is None:
        return {k: k for k in trainer.keys}
    if mapping == "is_agent":
        return {k: k.removeprefix(AGENT_PREFIX) for k in trainer.keys}
    assert isinstance(mapping, dict)
    inverse = {v: k for k, v in mapping.items()}
    if len(inverse) != len(mapping):
        raise ConfigError("name_mapping maps two checkpoint names to one trainer name")
    unknown = sorted(set(inverse) - set(trainer.keys))
    if unknown:
        raise ConfigError(f"name_mapping names the trainer key {unknown[0]!r}, which the trainer does not have")
    return {k: inverse.get(k, k) for k in trainer.keys}
