"""Ray actors for drafters: a replica hosts many sessions of one drafter plugin; pools keep N per drafter.

Each replica call answers with a status instead of raising, so the gRPC service can tell a bad
request (INVALID) from a plugin that broke (FAILED) or a session this process no longer has (LOST:
the actor was restarted). Ray restarts crashed replicas itself; a replica gone for good is
replaced in the same slot. Either way the service re-opens its sessions from the context it tracks.

Model drafters run on a GPU when their pool asks Ray for one (``PoolConfig.device`` and ``num_gpus``: a whole GPU
per replica, or a fraction so that replicas share one); the replica then drafts on the GPU Ray assigned it. A session
opened with ``lookahead`` > 0 drafts ahead between draft calls (``ahead``, ``lookahead.py``) when its session forks.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import os
import socket
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import ray
from ray.exceptions import ActorDiedError

from stree.drafter_service.lookahead import Lookahead
from stree.proto.rpc import is_loopback
from stree.protocols.drafter import DraftBudget, ForkableSession
from stree.protocols.sampling import SamplingParams
from stree.protocols.token_tree import TokenTree
from stree.protocols.registry import filter_options, get_drafter_factory, missing_options


log = logging.getLogger(__name__)


class ReplicaStatus(str, enum.Enum):
    """How a replica call ended (calls answer with a status instead of raising)."""

    OK = "ok"
    INVALID = "invalid"  # the request disagrees with the session (e.g. its context length)
    FAILED = "failed"  # the plugin raised or returned something that is not a TokenTree
    LOST = "lost"  # this process has no such session (the actor was restarted)
    DONE = "done"  # nothing (more) to draft ahead for this session now


OK, INVALID, FAILED, LOST, DONE = (ReplicaStatus.OK, ReplicaStatus.INVALID, ReplicaStatus.FAILED, ReplicaStatus.LOST,
                                   ReplicaStatus.DONE)
DEVICES = ("auto", "cpu", "cuda")
"""Where a replica's model drafter runs: ``auto`` on the GPU Ray assigned it if any, else the CPU; ``cuda`` requires
one (the replica refuses to start without it); ``cpu`` never asks for one."""


def gpu_ids() -> list[str]:
    """The GPUs Ray assigned this process (empty outside Ray or without any)."""
    try:
        import ray

        if ray.is_initialized():
            return [str(g) for g in ray.get_gpu_ids()]
    except Exception as exc:  # no Ray context (plain process)
        log.debug("no Ray GPU assignment: %r", exc)
    return []


def device_for_this_process(device: str = "auto") -> str:
    """``cuda`` or ``cpu`` for a replica asked to run on ``device`` (``DEVICES``); ``ValueError`` when ``cuda`` is
    asked and no GPU was assigned or none is usable."""
    import torch

    if device not in DEVICES:
        raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {device!r}")
    if device == "cpu":
        return "cpu"
    usable = bool(gpu_ids()) and torch.cuda.is_available()
    if device == "cuda" and not usable:
        raise ValueError(f"device cuda: this replica has no usable GPU (Ray assigned {gpu_ids() or 'none'}, "
                         f"torch sees {torch.cuda.device_count()} CUDA devices)")
    return "cuda" if usable else "cpu"


@dataclass
class HostedSession:
    """A session on a replica: the plugin's session, the context length it holds, and drafting ahead of it."""

    session: object
    length: int
    lookahead: int = 0  # hypotheses drafted ahead per tree (0: none)
    tree: Optional[TokenTree] = None  # the last tree it drafted (what the verifier is verifying)
    budget: Optional[DraftBudget] = None
    ahead: Optional[Lookahead] = None


class DrafterReplica:
    """Sessions of one drafter, keyed by session id; ``draft`` applies pending commits then drafts."""

    def __init__(self, name: str, factory: Callable, options: Optional[dict] = None, replica_id: str = "0",
                 device: str = "auto", dtype: Optional[str] = None):
        self.name = name
        self.replica_id = replica_id
        self.device = device_for_this_process(device)
        opts = dict(options or {})
        draft_model = opts.get("draft_model")
        if isinstance(draft_model, (str, os.PathLike)):
            from stree.verifier.model.checkpoint import load_draft_model
            from stree.verifier.model.lm import weights_dtype

            opts["draft_model"] = load_draft_model(draft_model, device=self.device, dtype=weights_dtype(dtype))
        self.drafter = factory(**filter_options(factory, opts))
        self.sessions: dict[str, HostedSession] = {}

    def info(self) -> dict:
        """Where this replica runs (also a readiness probe)."""
        return {
            "name": self.name,
            "replica": self.replica_id,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "device": self.device,
            "gpu_ids": gpu_ids(),
            "sessions": len(self.sessions),
        }

    def open(self, session_id: str, prompt_ids: Sequence[int], sampling: dict, lookahead: int = 0) -> tuple:
        """Start (or restart) session ``session_id`` from ``prompt_ids``; ``(OK, replica id, lookahead)`` where
        lookahead is how many hypotheses it drafts ahead (0 when its session cannot fork)."""
        self._drop(session_id)
        try:
            params = SamplingParams(**sampling)
            if len(prompt_ids) == 0:
                raise ValueError("the prompt must contain at least one token")
        except (TypeError, ValueError) as exc:
            return (INVALID, str(exc))
        try:
            session = self.drafter.open(list(prompt_ids), params)
        except ValueError as exc:
            return (INVALID, f"drafter {self.name!r} refused the session: {exc}")
        except Exception as exc:  # details to this replica's log; the client gets no tracebacks or paths
            log.warning("drafter %r failed to open a session: %r", self.name, exc)
            return (FAILED, f"drafter {self.name!r} failed to open a session")
        lookahead = max(0, int(lookahead)) if isinstance(session, ForkableSession) else 0
        self.sessions[session_id] = HostedSession(session, len(prompt_ids), lookahead)
        return (OK, self.replica_id, lookahead)

    def draft(self, session_id: str, commit_tokens: Sequence[int], context_length: int, budget: tuple) -> tuple:
        """Commit ``commit_tokens``, then draft for ``context_length``: ``(OK, TokenTree, seconds, hit)`` or
        ``(status, message)``. ``hit``: the commit was a hypothesis drafted ahead with this budget, whose fork is the
        session now and whose tree is the answer (drafted before; ``seconds`` is what it took then)."""
        entry = self.sessions.get(session_id)
        if entry is None:
            return (LOST, f"replica {self.replica_id} has no session {session_id}")
        if entry.length + len(commit_tokens) != context_length:
            return (
                INVALID,
                f"draft is for context length {context_length} but the session has "
                f"{entry.length} + {len(commit_tokens)} committed tokens",
            )
        budget = DraftBudget(*budget)
        t0 = time.perf_counter()
        try:
            hit = self._take_hypothesis(entry, commit_tokens, budget)
            if hit is not None:
                entry.length, entry.tree, entry.budget = context_length, hit.tree, budget
                return (OK, hit.tree, hit.seconds, True)
            if commit_tokens:
                entry.session.commit(list(commit_tokens))
            entry.length = context_length
            tree = entry.session.draft(budget)
            if not isinstance(tree, TokenTree):
                raise TypeError(f"draft returned {type(tree).__name__}, not a TokenTree")
        except Exception as exc:  # a broken plugin: drop the session, the service re-opens it
            log.warning("drafter %r failed to draft: %r", self.name, exc)
            self._drop(session_id)
            return (FAILED, f"drafter {self.name!r} failed to draft; the session is being re-opened")
        entry.tree, entry.budget = tree, budget
        return (OK, tree, time.perf_counter() - t0, False)

    def _take_hypothesis(self, entry: HostedSession, commit_tokens: Sequence[int], budget: DraftBudget):
        """The hypothesis drafted ahead for exactly ``commit_tokens`` under ``budget``, its fork made the session
        (the old session closed); None otherwise. Every other fork is closed either way."""
        ahead, entry.ahead = entry.ahead, None
        if ahead is None:
            return None
        hit = ahead.take(commit_tokens) if commit_tokens and budget == entry.budget else None
        ahead.close()
        if hit is None:
            return None
        old, entry.session = entry.session, hit.session
        old.close()
        return hit

    def ahead(self, session_id: str, context_length: int) -> tuple:
        """Draft the next hypothesis about the last tree of the session at ``context_length``:
        ``(OK, assumed tokens, TokenTree, seconds)``, ``(DONE, why)`` when there is nothing more to draft ahead, or
        ``(status, message)``. A plugin that raises here only ends drafting ahead for this tree."""
        entry = self.sessions.get(session_id)
        if entry is None:
            return (LOST, f"replica {self.replica_id} has no session {session_id}")
        if entry.length != context_length:
            return (INVALID, f"ahead of context length {context_length} but the session has {entry.length} tokens")
        if not entry.lookahead or entry.tree is None:
            return (DONE, "this session does not draft ahead")
        try:
            if entry.ahead is None:
                entry.ahead = Lookahead(entry.session, entry.tree, entry.budget, entry.lookahead)
            hypothesis = entry.ahead.next()
        except Exception as exc:  # a plugin that cannot fork or draft from a fork: no drafting ahead this time
            log.warning("drafter %r failed to draft ahead: %r", self.name, exc)
            if entry.ahead is not None:
                entry.ahead.close()
                entry.ahead = None
            entry.tree = None
            return (DONE, f"drafter {self.name!r} failed to draft ahead")
        if hypothesis is None:
            return (DONE, "every hypothesis is drafted")
        return (OK, hypothesis.tokens, hypothesis.tree, hypothesis.seconds)

    def close(self, session_id: str) -> None:
        self._drop(session_id)

    def num_sessions(self) -> int:
        return len(self.sessions)

    def _drop(self, session_id: str) -> None:
        entry = self.sessions.pop(session_id, None)
        if entry is not None:
            try:
                if entry.ahead is not None:
                    entry.ahead.close()
                entry.session.close()
            except Exception as exc:  # closing is best effort; the session is gone either way
                log.warning("closing session %s of drafter %r failed: %r", session_id, self.name, exc)


NAMESPACE = "stree"
RemoteReplica = ray.remote(DrafterReplica)


LOOPBACK = "127.0.0.1"
_CLUSTER_SWITCH = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def init_ray(address: str = "local", num_cpus: int = 2, node_ip: str = LOOPBACK) -> None:
    """Connect to Ray: ``local`` starts a private instance, ``auto`` joins the running cluster, else an address.

    A ``local`` instance's processes (GCS, raylet, workers, dashboard agent, runtime-env agent) listen on
    ``node_ip`` only: 127.0.0.1 unless told otherwise. Ray turns a loopback ``_node_ip_address`` into the
    machine's reachable address, except where it runs single-machine clusters (its Windows/macOS switch,
    ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``); that switch is held off while the instance starts.
    Ray 2.5x+ uses token auth (``RAY_AUTH_MODE=token``): ``ray.init`` of a local instance makes a
    token itself; joining a cluster needs the cluster's token in ``RAY_AUTH_TOKEN`` or
    ``RAY_AUTH_TOKEN_PATH`` (or ``~/.ray/auth_token``), which ``deploy/local_cluster.sh`` sets up.
    Does nothing when Ray is already initialised in this process.
    """
    if ray.is_initialized():
        return
    if address != "local":
        ray.init(address=address, namespace=NAMESPACE, logging_level="WARNING")
        return
    kwargs = dict(num_cpus=num_cpus, include_dashboard=False, namespace=NAMESPACE, logging_level="WARNING")
    if not is_loopback(node_ip):
        ray.init(_node_ip_address=node_ip, **kwargs)
        return
    from ray._private import ray_constants

    saved = ray_constants.ENABLE_RAY_CLUSTER, os.environ.get(_CLUSTER_SWITCH)
    ray_constants.ENABLE_RAY_CLUSTER, os.environ[_CLUSTER_SWITCH] = False, "0"
    try:
        ray.init(**kwargs)
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved[0]
        if saved[1] is None:
            os.environ.pop(_CLUSTER_SWITCH, None)
        else:
            os.environ[_CLUSTER_SWITCH] = saved[1]


def cluster_has_gpu() -> bool:
    return ray.cluster_resources().get("GPU", 0) >= 1


@dataclass
class DrafterSpec:
    """What a pool runs: a registered drafter name, its factory and the options it is built with."""

    name: str
    factory: Callable
    options: dict = field(default_factory=dict)

    @classmethod
    def resolve(cls, name: str, options: Optional[dict] = None) -> "DrafterSpec":
        """Look ``name`` up in the registry (``ValueError`` for an unknown one, or one missing required options,
        before any actor starts)."""
        factory = get_drafter_factory(name)
        missing = missing_options(factory, options or {})
        if missing:
            wanted = ", ".join(f"--option {name}.{m}=..." for m in missing)
            raise ValueError(f"drafter {name!r} needs option(s) {', '.join(missing)} (set {wanted})")
        return cls(name=name, factory=factory, options=dict(options or {}))

    @property
    def uses_model(self) -> bool:
        return self.options.get("draft_model") is not None


@dataclass
class Replica:
    slot: int
    handle: object
    actor_name: str
    sessions: set = field(default_factory=set)
    replacing: bool = False
    generation: int = 0
    failed_at: float = float("-inf")  # monotonic time of the last failed call
    inflight: int = 0  # calls on their way to it (drafting ahead waits while another session's call is)

    def suspect(self, window_s: float = 30.0) -> bool:
        """Failed recently (e.g. Ray is restarting it): place sessions elsewhere when possible."""
        return time.monotonic() - self.failed_at < window_s


@dataclass
class PoolConfig:
    replicas: int = 2
    max_restarts: int = 3
    num_cpus: float = 0.0
    num_gpus: float = 1.0  # per replica of a model drafter on a GPU: 1 a GPU each, 0.5 two replicas per GPU
    resources: dict = field(default_factory=dict)  # custom Ray resources per replica (pins them to nodes)
    ready_timeout_s: float = 120.0
    device: str = "auto"  # where model drafters run (``DEVICES``): auto uses GPUs when the cluster has them
    dtype: Optional[str] = None  # model drafters' weights (a name in ``lm.DTYPES``); None keeps each checkpoint's

    def __post_init__(self):
        from stree.verifier.model.lm import weights_dtype

        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        weights_dtype(self.dtype)  # a name it does not know is refused here, not in every replica
        if not 0 <= self.num_gpus:
            raise ValueError(f"num_gpus must be >= 0, got {self.num_gpus}")
        if self.device == "cuda" and self.num_gpus <= 0:
            raise ValueError("device cuda needs num_gpus > 0 per replica (a whole GPU, or a share of one)")


def replica_gpus(config: PoolConfig, uses_model: bool) -> float:
    """The GPUs (Ray ``num_gpus``) each replica of a pool asks for: ``config.num_gpus`` for a model drafter on a
    GPU, else 0. ``ValueError`` when ``device`` is cuda and the cluster has no GPU."""
    if config.device == "cpu" or not uses_model:
        return 0.0
    if config.device == "cuda" and not cluster_has_gpu():
        raise ValueError("device cuda: the Ray cluster has no GPU (start it with GPUs, or use device auto or cpu)")
    return config.num_gpus if cluster_has_gpu() else 0.0


class ReplicaPool:
    """The replicas of one drafter."""

    def __init__(self, spec: DrafterSpec, config: PoolConfig = PoolConfig()):
        if config.replicas < 1:
            raise ValueError(f"a drafter needs at least one replica, got {config.replicas}")
        self.spec = spec
        self.config = config
        self.instance = uuid.uuid4().hex[:8]
        self.replicas: list[Replica] = []
        self.num_gpus = replica_gpus(config, spec.uses_model)

    def _new_actor(self, slot: int, generation: int):
        actor_name = f"stree-drafter-{self.spec.name}-{slot}-{self.instance}-{generation}"
        handle = RemoteReplica.options(
            name=actor_name,
            namespace=NAMESPACE,
            max_restarts=self.config.max_restarts,
            max_task_retries=0,  # a draft call is not idempotent (it carries commits): the service retries
            num_cpus=self.config.num_cpus,
            num_gpus=self.num_gpus,
            resources=dict(self.config.resources),
            scheduling_strategy="SPREAD",
        ).remote(self.spec.name, self.spec.factory, self.spec.options, f"{self.spec.name}/{slot}",
                 self.config.device if self.spec.uses_model else "cpu", self.config.dtype)
        return handle, actor_name

    async def start(self) -> None:
        """Create every replica and wait until each has built its drafter."""
        for slot in range(self.config.replicas):
            handle, actor_name = self._new_actor(slot, 0)
            self.replicas.append(Replica(slot=slot, handle=handle, actor_name=actor_name))
        try:
            await asyncio.wait_for(
                asyncio.gather(*(r.handle.info.remote() for r in self.replicas)), self.config.ready_timeout_s
            )
        except Exception:
            self.shutdown()
            raise

    def acquire(self, session_id: str) -> Optional[Replica]:
        """The live replica with the fewest sessions, healthy ones first (None while all are being replaced)."""
        live = [r for r in self.replicas if not r.replacing]
        if not live:
            return None
        best = min(live, key=lambda r: (r.suspect(), len(r.sessions), r.slot))
        best.sessions.add(session_id)
        return best

    def release(self, replica: Optional[Replica], session_id: str) -> None:
        if replica is not None:
            replica.sessions.discard(session_id)

    def report_failure(self, replica: Replica, exc: BaseException) -> None:
        """A call to ``replica`` failed; replace the actor if Ray will not restart it."""
        replica.failed_at = time.monotonic()
        if isinstance(exc, ActorDiedError) and not replica.replacing:
            replica.replacing = True
            log.warning("drafter replica %s died for good (%s); replacing it", replica.actor_name, exc)
            asyncio.get_running_loop().create_task(self._replace(replica))

    async def _replace(self, replica: Replica) -> None:
        delay = 0.2
        while True:
            generation = replica.generation + 1
            handle, actor_name = self._new_actor(replica.slot, generation)
            try:
                await asyncio.wait_for(handle.info.remote(), self.config.ready_timeout_s)
            except Exception as exc:
                log.warning("replacement replica %s failed to start (%r); retrying", actor_name, exc)
                ray.kill(handle)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)
                continue
            replica.handle, replica.actor_name, replica.generation = handle, actor_name, generation
            replica.sessions.clear()
            replica.failed_at = float("-inf")
            replica.replacing = False
            log.warning("drafter replica slot %s of %r is back as %s", replica.slot, self.spec.name, actor_name)
            return

    def num_sessions(self) -> int:
        return sum(len(r.sessions) for r in self.replicas)

    def shutdown(self) -> None:
        for r in self.replicas:
            try:
                ray.kill(r.handle)
            except Exception as exc:  # already gone
                log.debug("kill %s: %r", r.actor_name, exc)
        self.replicas = []


class PoolLimitReached(RuntimeError):
    """Starting one more drafter pool would pass the host's ``max_pools``."""


class DrafterHost:
    """Every drafter pool of one service, started up front or on first use.

    ``served``: the only names clients may open (None: any registered name); at most ``max_pools``
    pools run at once, so clients cannot make the service start actors without bound.
    """

    def __init__(self, options_for: Callable[[str], dict], config: PoolConfig = PoolConfig(),
                 served: Optional[Sequence[str]] = None, max_pools: int = 4):
        self.options_for = options_for
        self.config = config
        self.served = None if served is None else frozenset(served)
        self.max_pools = max_pools
        self.pools: dict[str, ReplicaPool] = {}
        self._starting: dict[str, asyncio.Task] = {}

    async def pool(self, name: str) -> ReplicaPool:
        """The pool of drafter ``name``, starting it if needed (``ValueError`` when unknown or not served,
        ``PoolLimitReached`` when ``max_pools`` already run)."""
        if name in self.pools:
            return self.pools[name]
        task = self._starting.get(name)
        if task is None:
            get_drafter_factory(name)  # unknown names: the registry's ValueError
            if self.served is not None and name not in self.served:
                raise ValueError(f"drafter {name!r} is not served here (served: {', '.join(sorted(self.served))})")
            if len(self.pools) + len(self._starting) >= self.max_pools:
                raise PoolLimitReached(f"this service already runs {self.max_pools} drafters, its limit")
            spec = DrafterSpec.resolve(name, self.options_for(name))
            task = asyncio.get_running_loop().create_task(self._start(spec))
            self._starting[name] = task
        try:
            return await asyncio.shield(task)
        finally:
            if task.done():
                self._starting.pop(name, None)

    async def _start(self, spec: DrafterSpec) -> ReplicaPool:
        pool = ReplicaPool(spec, self.config)
        await pool.start()
        self.pools[spec.name] = pool
        log.info("drafter %r: %d replicas ready", spec.name, len(pool.replicas))
        return pool

    def num_sessions(self) -> int:
        return sum(p.num_sessions() for p in self.pools.values())

    def shutdown(self) -> None:
        for pool in self.pools.values():
            pool.shutdown()
        self.pools = {}
