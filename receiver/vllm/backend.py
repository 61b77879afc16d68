"""The ``weightsync`` weight-transfer engine, run by every vLLM worker.

vLLM drives it through its own API (offline ``LLM.init_weight_transfer_engine`` /
``start_weight_update`` / ``update_weights`` / ``finish_weight_update``, or the same as
``vllm serve`` routes). Each worker runs a weightsync ``Receiver`` on its own thread and
event loop, over the worker's model as ``layout.derive_layout`` maps it: versions are
received, validated and staged in the background while vLLM generates (``hold=True``),
and written only inside ``update_weights``, at a cost proportional to what changed.

What a caller can rely on, beyond vLLM's contract for a backend:

- ``init_weight_transfer_engine`` returns once the worker holds the trainer's current
  version (bootstrapped), so an engine may start from ``--load-format dummy``.
- ``update_weights`` commits every staged version up to ``update_info["version"]`` in
  order, each all or nothing, and returns with the weights at that version or later
  (a resync may land past it); every worker of the engine ends at the same version.
  vLLM's ``sparse_nccl`` documents that a failed update leaves a worker half-written;
  here a failure (timeout, a corrupted patch, a lost trainer) raises through vLLM and
  the weights stay at the last fully applied version.
- ``start_weight_update`` and ``finish_weight_update`` hold nothing: patches land in place.
- Calls come from vLLM's worker thread one at a time (vLLM serialises its RPCs);
  a second ``init_weight_transfer_engine`` is refused.
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
from collections.abc import Coroutine, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine, WeightTransferInitInfo, WeightTransferUpdateInfo

from protocol.errors import ConfigError, StateError, WeightSyncError, WeightSyncTimeout
from protocol.net.security import CurveClient, KeyPair, z85_key
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
from .adapters import parse_specs
from .kinds import How
from .layout import Layout, Prepack, derive_layout
from .reload import reload
from .steps import StepVersions

if TYPE_CHECKING:
    from .lora import AdapterSlots

log = logging.getLogger(__name__)
T = TypeVar("T")
# Elements read back per tensor after each commit (WeightsyncInitInfo.check_writes):
# benchmarks/vllm_hold.py measures what it adds to the hold (docs/performance.md).
CHECK_WRITES = 8


@dataclass
class WeightsyncInitInfo(WeightTransferInitInfo):
    """``init_info`` of ``init_weight_transfer_engine``.

    ``endpoint``: the trainer's ``Sender`` (or a list tried in turn: relays, failover).
    ``config``: the sync YAML's content as a dict, or its path. ``curve``: ``{"public",
    "secret", "server_key"}`` (Z85) for CURVE beyond loopback. ``name_mapping``: this
    engine's checkpoint name -> the trainer's name (a dict), or ``"is_agent"``.
    ``timeout``: seconds for the handshake and bootstrap. ``prepack``: where vLLM re-packs
    layers after loading (CPU), re-pack them while a version is staged, on copies, so that
    ``update_weights`` only swaps them in (one more copy of those layers' weights).
    ``check_writes``: after each commit, read back this many of the elements written into
    each tensor and compare them with the staged values (``receiver.apply.readback``); a map
    that wrote elsewhere fails the update with ``WriteCheckError`` instead of serving. 0: off.
    ``lora``: the trainer sends LoRA adapters only (PEFT names), written into the engine's
    adapter slots in place, the base weights untouched: ``{adapter name: {"id", "name", "r",
    "lora_alpha", "target_modules"}}`` (``receiver/vllm/adapters.py``, ``lora.py``)."""

    endpoint: str | list[str]
    config: dict[str, Any] | str | None = None
    curve: dict[str, str] | None = None
    name_mapping: dict[str, str] | str | None = None
    timeout: float = 120.0
    insecure_plaintext: bool = False
    prepack: bool = True
    check_writes: int = CHECK_WRITES
    lora: dict[str, dict[str, Any]] | None = None

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
        if self.lora is not None:
            parse_specs(self.lora)  # a ConfigError unless every adapter has its id, name and config

    @property
    def endpoints(self) -> list[str]:
        return [self.endpoint] if isinstance(self.endpoint, str) else list(self.endpoint)

    def curve_client(self) -> CurveClient | None:
        if self.curve is None:
            return None
        keys = KeyPair(z85_key(self.curve["public"], "curve.public"), z85_key(self.curve["secret"], "curve.secret"))
        return CurveClient(keys, z85_key(self.curve["server_key"], "curve.server_key"))


@dataclass
class WeightsyncUpdateInfo(WeightTransferUpdateInfo):
    """``update_info`` of ``update_weights``: ``version`` an int, a string ending in
    digits (``"global_step_12"``) or None for the sender's current version; ``timeout``
    in seconds; ``verify_checksum`` compares the state digest with the trainer's."""

    version: int | str | None = None
    timeout: float | None = 60.0
    verify_checksum: bool = False

    def __post_init__(self) -> None:
        parse_version(self.version)  # a ConfigError (a ValueError too) unless it names a version
        if self.timeout is not None and (isinstance(self.timeout, bool) or not isinstance(self.timeout, int | float) or self.timeout <= 0):
            raise ConfigError(f"update_info.timeout must be a positive number of seconds or null, got {self.timeout!r}")
        if type(self.verify_checksum) is not bool:
            raise ConfigError(f"update_info.verify_checksum must be true or false, got {self.verify_checksum!r}")


@dataclass
class _Ahead:
    pending: PendingVersion  # the staged version the layers were re-packed for
    prepack: Prepack


class _LoopThread:
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


class WeightsyncEngine(WeightTransferEngine[WeightsyncInitInfo, WeightsyncUpdateInfo]):
    """vLLM's weight-transfer engine over a weightsync ``Receiver`` (see the module doc)."""

    init_info_cls = WeightsyncInitInfo
    update_info_cls = WeightsyncUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.receiver: Receiver | None = None
        self.layout: Layout | None = None
        self._thread: _LoopThread | None = None
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
        self.adapters: AdapterSlots | None = None  # init_info.lora: the adapters' slots (receiver/vllm/lora.py)

    # -- vLLM's API ---------------------------------------------------------------------
    def init_transfer_engine(self, init_info: WeightsyncInitInfo) -> None:
        if self.receiver is not None:
            raise StateError("the weightsync engine is already initialised; shut it down first")
        started = time.perf_counter()
        thread = self._thread = _LoopThread(f"weightsync-{self._rank()}")
        try:
            curve = init_info.curve_client()
            trainer = thread.run(
                ask_metadata(init_info.endpoints, curve=curve, insecure_plaintext=init_info.insecure_plaintext, timeout=init_info.timeout),
                init_info.timeout + 5, "asking the trainer for its checkpoint names",
            )
            names = self._checkpoint_names(trainer, init_info.name_mapping)
            dtype = self.model_config.dtype  # what the engine's weights are in: every float tensor is declared so
            if not isinstance(dtype, torch.dtype):
                raise ConfigError(f"the engine's model dtype is {dtype!r}, not a torch dtype")
            declared = [(names[k], shape, dtype if d.is_floating_point else d) for k, shape, d in zip(trainer.keys, trainer.shapes, trainer.dtypes)]
            if init_info.lora is not None:  # the adapters only, into vLLM's LoRA slots; refused before any write
                from .lora import AdapterSlots

                shapes = [(names[k], tuple(shape)) for k, shape in zip(trainer.keys, trainer.shapes)]
                self.adapters = AdapterSlots(self.model, shapes, parse_specs(init_info.lora), verify=init_info.check_writes > 0)
                layout = self.layout = self.adapters.layout
            else:
                layout = self.layout = derive_layout(self.model, declared)
            state = {k: layout.tensors[names[k]] for k in trainer.keys}  # under the trainer's names
            self._keys, self._names = trainer.keys, names
            self.check_writes = init_info.check_writes
            self.prepack = init_info.prepack and bool(layout.shadows)
            # layers vLLM re-packs into kernel copies here (0 where this CPU's vLLM keeps the
            # loaded weights, e.g. oneDNN linear unavailable): only those can be re-packed ahead
            self.totals["layers_shadowed"] = len(layout.shadows)
            receiver = Receiver(
                state, init_info.endpoints, init_info.config, hold=True, identity=self._identity(),
                curve=curve, insecure_plaintext=init_info.insecure_plaintext,
                hooks=StrategyHooks(on_commit=(self._committed,), on_staged=self._prepack if layout.shadows else None),
            )
            self.receiver = receiver
            self.step_versions = StepVersions(lambda: receiver.version)
            self._step_hook = self.model.register_forward_pre_hook(self.step_versions.forward)
            self._log_kinds(layout)
            thread.run(receiver.start(init_info.timeout), init_info.timeout + 5, "the handshake and bootstrap")
            layers = layout.repack(layout.layers_of(names.values()))
            self._reload(layout.reloads.mirrors)
            self._stale.clear()
        except BaseException:
            self.shutdown()
            raise
        log.info(
            "weightsync: worker %s at v%s after %.2fs (%d tensors, %d placed elsewhere, %d layers re-packed)",
            self._rank(), receiver.version, time.perf_counter() - started, len(state), len(layout.unmapped), layers,
        )

    def start_weight_update(self) -> None:
        self._receiver()

    def receive_weights(self, update_info: WeightsyncUpdateInfo) -> None:
        receiver, thread = self._receiver(), self._thread
        assert thread is not None and self.layout is not None
        started = time.perf_counter()
        target = self._agree_on_target(parse_version(update_info.version), update_info)
        limit = None if update_info.timeout is None else update_info.timeout + 5
        for _ in range(3):  # workers may land on different versions (a resync past the target): even them out
            if receiver.version is None or target is None or receiver.version < target:
                thread.run(receiver.update_weights(target, False, update_info.timeout), limit, f"update_weights to v{target}")
            versions = self._gather(receiver.version)
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
        if update_info.verify_checksum:
            thread.run(receiver.update_weights(receiver.version, True, update_info.timeout), limit, "verify_checksum")

    def finish_weight_update(self) -> None:
        self._receiver()

    def shutdown(self) -> None:
        receiver, thread = self.receiver, self._thread
        self.receiver = self._thread = None
        if self._step_hook is not None:  # step_versions stays readable: what ran, up to here
            self._step_hook.remove()
            self._step_hook = None
        if self.adapters is not None:
            self.adapters.close()
            self.adapters = None
        if thread is None:
            return
        try:
            if receiver is not None:
                thread.run(receiver.close(), 15)
        finally:
            thread.stop()

    # -- internals ----------------------------------------------------------------------
    def _receiver(self) -> Receiver:
        if self.receiver is None:
            raise StateError("the weightsync engine is not initialised: call init_weight_transfer_engine first")
        if not self.receiver.healthy:
            raise WeightSyncError(f"the weightsync receiver has stopped: {self.receiver.status()['error']}")
        return self.receiver

    def _committed(self, pending: PendingVersion) -> None:
        """Inside the commit (the worker waits in update_weights, vLLM runs nothing): swap
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
        if self.adapters is not None:  # registers an adapter vLLM lacks; finish_weight_update rebuilds and reads back the rest
            self.adapters.commit(names)
            started = time.perf_counter()
            count += self.adapters.check(writes, self.check_writes, self._check_rng)
            seconds += time.perf_counter() - started
        self._checked = (self._checked[0] + seconds, self._checked[1] + count)
        for layer in self.layout.layers_of(names):
            if layer not in installed:
                self._stale[layer] = None
            else:
                self._stale.pop(layer, None)

    def _reload(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Hand the whole tensors of the layers the map does not understand (``kinds.py``)
        to vLLM's own reload; inside the commit, so a failure leaves the version unpublished."""
        if not weights:
            return
        assert self.layout is not None
        reload(self.model, self.model_config, weights)
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
                            "whole tensors through vLLM's load_weights", count, name, reason)
            else:
                log.info("weightsync: %d %s layers are mapped through their post-load permutation", count, name)

    def _check(self, writes: list[tuple[str, StagedUpdate]], targets: Mapping[str, Any]) -> tuple[float, int]:
        """Read back a sample of each mapped tensor ``writes`` wrote into ``targets``;
        returns the seconds it took and how many tensors it read. Only mapped tensors (``Placed``) are read: a plain
        target is one view of one parameter, proven by the map's probes, and written by the
        receiver's own paths."""
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
        touches on copies, while vLLM generates, and drop the updates those copies hold
        entirely from what the commit writes. A failure only costs the hold: those layers
        re-pack inside update_weights. Off (``prepack`` False): nothing."""
        self._ahead = None
        if not self.prepack or pending.type is not MessageType.PATCH:
            return  # a resync re-packs every layer inside update_weights
        layout = self.layout
        assert layout is not None
        writes = self._writes(pending)
        started = time.perf_counter()
        try:
            prepack = await asyncio.to_thread(layout.prepack, layout.layers_of(dict.fromkeys(name for name, _ in writes)), writes)
            # What the copies hold entirely is not written again in the hold: read it back here.
            ahead = [(name, u) for name, u in writes if layout.holds(prepack, name)]
            await asyncio.to_thread(self._check, ahead, prepack.targets)
        except Exception as e:  # logged; update_weights re-packs (and reads back) these layers inline
            log.warning("weightsync: re-packing v%s ahead failed, it will re-pack inside update_weights: %s", pending.version, e)
            return
        partly = {id(u) for name, u in writes if not layout.holds(prepack, name)}  # some name of it is not in the copies
        pending.updates[:] = [u for u in pending.updates if id(u) in partly]
        self._ahead = _Ahead(pending, prepack)
        self.last_prepack_s = time.perf_counter() - started

    def _checkpoint_names(self, trainer: ModelMetadata, mapping: dict[str, str] | str | None) -> dict[str, str]:
        """Trainer name -> the checkpoint name this engine's load_weights takes."""
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

    def _agree_on_target(self, target: int | None, update_info: WeightsyncUpdateInfo) -> int | None:
        """One version for every worker: "the sender's current one" is asked once."""
        if target is None and self._world() > 1:
            receiver, thread = self._receiver(), self._thread
            assert thread is not None
            if self._group_rank() == 0:
                target = thread.run(receiver.sender_version(update_info.timeout), update_info.timeout, "asking the sender's version")
            target = self._broadcast(target)
        return target

    def _world(self) -> int:
        try:
            from vllm.distributed.parallel_state import get_world_group

            return int(get_world_group().world_size)
        except (ImportError, AssertionError):
            return 1

    def _group_rank(self) -> int:
        from vllm.distributed.parallel_state import get_world_group

        return int(get_world_group().rank_in_group)

    def _broadcast(self, value: Any) -> Any:
        from vllm.distributed.parallel_state import get_world_group

        group = get_world_group()
        box = [value]
        torch.distributed.broadcast_object_list(box, src=group.ranks[0], group=group.cpu_group)
        return box[0]

    def _gather(self, value: Any) -> list[Any]:
        if self._world() == 1:
            return [value]
        from vllm.distributed.parallel_state import get_world_group

        group = get_world_group()
        out: list[Any] = [None] * group.world_size
        torch.distributed.all_gather_object(out, value, group=group.cpu_group)
        return out

    def _rank(self) -> int:
        return self._group_rank() if self._world() > 1 else 0

    def _identity(self) -> str:
        return f"vllm-{socket.gethostname()}-{os.getpid()}-rank{self._rank()}"
