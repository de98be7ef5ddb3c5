"""The one seam to Ray's private code: every import of ``ray._private``, ``ray.*._internal`` and
``ray.experimental``, and every override of a private hook, lives here and nowhere else in the kit.

Ray is pinned to 2.60 (Ray Train V2). Each item below says what it relies on and what the kit does
when it is missing; ``ASSUMPTIONS`` holds one check per item, run against the installed Ray by
``make check-ray`` (``python -m ray_app.shared.ray_seam``) and by ``tests/unit/test_ray_seam.py``, so an
upgrade of Ray shows here, and only here, what broke. ``tests/unit/test_import_graph.py`` fails on a
private Ray import anywhere else in ``ray_app``.

Where the code runs: the driver (``lean_local_ray``, ``WorkerLogStream``, ``trainer_class``,
``kv_*``), Ray Train's controller actor (``polling_controller``, ``failure_policy_base``, ``FixedPolicyWithoutAutoscaler``,
``ElasticPolicyHook``, ``address_and_port``, ``TORCH_FRAMEWORK``) and the workers
(``kv_*``, ``draining_nodes``, ``worker_callback_base``, ``quiet_train_loggers``).
Imports of Ray stay inside the functions where a command that needs no Ray (``ray-app checkpoints``,
``ray-app config``) must not pay for them.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import sys
from dataclasses import dataclass
from typing import Callable

# ---------------------------------------------------------------- the assumptions, one per item


@dataclass(frozen=True)
class Assumption:
    """What the kit relies on in Ray, and what it does when that is gone."""

    item: str  # the kit's name for it (a function or class of this module)
    relies_on: str  # module:attribute (and what of it) in Ray
    without_it: str  # what the kit does when the check fails
    check: Callable[[], str | None]  # None when the installed Ray has it, else what is missing


def _has(module: str, *attributes: str, callable_: bool = False) -> Callable[[], str | None]:
    def check() -> str | None:
        try:
            top = importlib.import_module(module)
        except ImportError as exc:
            return f"no module {module} ({exc})"
        for name in attributes:
            obj = top
            for part in name.split("."):
                if not hasattr(obj, part):
                    return f"{module} has no {name}"
                obj = getattr(obj, part)
            if callable_ and not callable(obj):
                return f"{module}.{name} is not callable"
        return None

    return check


ASSUMPTIONS: list[Assumption] = [
    Assumption("lean_local_ray", "ray._private.node:Node.start_monitor, Node.start_api_server (methods)",
               "a local Ray starts with its autoscaler monitor and API server (~1.8 s more on 2 cores)",
               _has("ray._private.node", "Node.start_monitor", "Node.start_api_server", callable_=True)),
    Assumption("lean_local_ray (own session)", "ray._private.services:ConsolePopen (the Popen every Ray process "
                                               "starts with), ray._private.utils:detect_fate_sharing_support",
               "a SIGTERM to the driver's process group kills the local Ray at once: the run ends without its "
               "stop checkpoint (the driver waits 60 s for the GCS)",
               _has("ray._private.services", "ConsolePopen")),
    Assumption("WorkerLogStream", "ray._private.ray_logging:global_worker_stdstream_dispatcher "
                                  "(add_handler, remove_handler)",
               "the driver waits a fixed 0.3 s for the workers' last lines instead of until the stream is quiet",
               _has("ray._private.ray_logging", "global_worker_stdstream_dispatcher.add_handler",
                    "global_worker_stdstream_dispatcher.remove_handler", callable_=True)),
    Assumption("kv_put, kv_get, kv_del", "ray.experimental.internal_kv:_internal_kv_put/_get/_del",
               "rank 0's result and the driver's stop request cannot be passed: the kit stops with a one-line "
               "error naming this seam (no run could end with its summary)",
               _has("ray.experimental.internal_kv", "_internal_kv_put", "_internal_kv_get", "_internal_kv_del",
                    callable_=True)),
    Assumption("draining_nodes", "ray._private.state:state.get_draining_nodes()",
               "Ray's drain notice is not seen: a node drained without a SIGTERM is a killed worker "
               "(restart from the newest checkpoint) instead of a preemption checkpoint",
               _has("ray._private.state", "state.get_draining_nodes", callable_=True)),
    Assumption("worker_callback_base", "ray.train.v2._internal.execution.callback:WorkerCallback "
                                       "(after_init_train_context)",
               "the preemption notice is not installed in the workers: a SIGTERM ends a worker at once",
               _has("ray.train.v2._internal.execution.callback", "WorkerCallback.after_init_train_context")),
    Assumption("worker_group_callback_base, placement_group_of",
               "ray.train.v2._internal.execution.callback:WorkerGroupCallback (after_worker_group_start), "
               "a worker group's get_worker_group_state().placement_group_handle.placement_group",
               "a sweep's stopped trial keeps its workers' placement group until the sweep ends (trials after it "
               "may wait for CPUs)",
               _has("ray.train.v2._internal.execution.callback", "WorkerGroupCallback.after_worker_group_start")),
    Assumption("tune_without_credential_copies", "ray.tune.execution.class_cache:ENV_VARS_TO_PROPAGATE (a set of "
                                                 "names Tune copies into each trial actor's runtime_env)",
               "a sweep's trial actors get the driver's AWS keys in their runtime_env: Ray writes them in its "
               "runtime-env agent's log and the actors' command lines",
               _has("ray.tune.execution.class_cache", "ENV_VARS_TO_PROPAGATE.discard", callable_=True)),
    Assumption("quiet_train_loggers", "ray.train.v2._internal.execution.context (its file names Ray Train's "
                                      "report logger) and ray.train.v2._internal.util (its logger logs "
                                      "'Error in training function')",
               "Ray Train's per-report INFO lines and its copy of errors the driver shows reach the console",
               _has("ray.train.v2._internal.execution.context", "__file__")),
    Assumption("group_torn_down", "ray.exceptions:RayActorError, raised in a worker from a call into the "
                                  "ray.train package (a report's sync with the group's SynchronizationActor)",
               "a worker whose group Ray Train tears down (another rank died) shows Ray's traceback once "
               "under the restart line",
               _has("ray.exceptions", "RayActorError")),
    Assumption("failure_policy_base", "ray.train.v2._internal.execution.failure_handling:DefaultFailurePolicy "
                                      "(make_decision, failure_config, _worker_group_failures, "
                                      "_controller_failures), FailureDecision (RETRY, RAISE), "
                                      ".default:_is_preemption_failure",
               "the kit stops before training with a one-line error naming this seam: without its policy a "
               "user's bug would spend every restart",
               _has("ray.train.v2._internal.execution.failure_handling", "DefaultFailurePolicy.make_decision",
                    "FailureDecision.RETRY", "FailureDecision.RAISE")),
    Assumption("is_preemption_failure", "ray.train.v2._internal.execution.failure_handling.default:"
                                        "_is_preemption_failure",
               "a restart after Ray's own preemption is named as a counted restart",
               _has("ray.train.v2._internal.execution.failure_handling.default", "_is_preemption_failure",
                    callable_=True)),
    Assumption("FixedPolicyWithoutAutoscaler", "ray.train.v2._internal.execution.scaling_policy.fixed:"
                                               "FixedScalingPolicy (after_controller_start sets "
                                               "_coordinator_client)",
               "a local run keeps Ray's autoscaling coordinator (one actor more, ~2.4 s of start-up)",
               _has("ray.train.v2._internal.execution.scaling_policy.fixed",
                    "FixedScalingPolicy.after_controller_start")),
    Assumption("ElasticPolicyHook", "ray.train.v2._internal.execution.scaling_policy.elastic:ElasticScalingPolicy "
                                    "(_count_possible_workers, _latest_reserved_resources, "
                                    "after_controller_state_update), "
                                    "ray.train.v2._internal.exceptions:WorkerGroupStartupTimeoutError",
               "an elastic run after a lost node asks for the same group size again (one start timeout more)",
               _has("ray.train.v2._internal.execution.scaling_policy.elastic",
                    "ElasticScalingPolicy._count_possible_workers",
                    "ElasticScalingPolicy.after_controller_state_update")),
    Assumption("startup_timeout_error", "ray.train.v2._internal.exceptions:WorkerGroupStartupTimeoutError "
                                        "(num_workers)",
               "as ElasticPolicyHook", _has("ray.train.v2._internal.exceptions", "WorkerGroupStartupTimeoutError")),
    Assumption("address_and_port", "ray.train._internal.utils:get_address_and_port",
               "the process group cannot rendezvous: the kit stops with a one-line error naming this seam",
               _has("ray.train._internal.utils", "get_address_and_port", callable_=True)),
    Assumption("TORCH_FRAMEWORK", "ray.train.v2._internal.util:TrainingFramework.TORCH",
               "the backend config cannot name its framework: the kit stops with a one-line error",
               _has("ray.train.v2._internal.util", "TrainingFramework.TORCH")),
    Assumption("polling_controller", "ray.train.v2.api.data_parallel_trainer:TrainController (the class "
                                     "_initialize_and_run_controller starts as the controller actor), "
                                     "TrainController._poll_workers (an async method that sleeps out "
                                     "_health_check_interval_s since the last poll, then polls every worker)",
               "the controller polls its workers at the fixed interval (RAY_TRAIN_HEALTH_CHECK_INTERVAL_S: 0.1 s "
               "for small groups), about 2 % of a 2-core machine's CPU",
               _has("ray.train.v2.api.data_parallel_trainer", "TrainController._poll_workers", callable_=True)),
    Assumption("trainer_class", "ray.train.torch:TorchTrainer private hooks _create_default_callbacks, "
                                "_register_sigint_handler, _initialize_and_run_controller(failure_policy=, "
                                "scaling_policy=)",
               "the kit stops before training with a one-line error naming the missing hook",
               _has("ray.train.torch", "TorchTrainer._create_default_callbacks",
                    "TorchTrainer._register_sigint_handler", "TorchTrainer._initialize_and_run_controller",
                    callable_=True)),
]


def broken() -> list[tuple[Assumption, str]]:
    """Each assumption the installed Ray breaks, with what is missing."""
    out = []
    for a in ASSUMPTIONS:
        try:
            problem = a.check()
        except Exception as exc:  # a check must report, never crash
            problem = f"{type(exc).__name__}: {exc}"
        if problem:
            out.append((a, problem))
    return out


class RaySeamBroken(RuntimeError):
    """The installed Ray lacks something the kit cannot train without (``make check-ray`` lists it)."""


# ---------------------------------------------------------------- driver: a lean local Ray


@contextlib.contextmanager
def lean_local_ray(api_server: bool):
    """While a local Ray starts: no autoscaler monitor, and (unless ``api_server``) no API server.

    Ray has no public call that starts a local Ray without them; the kit replaces ``Node.start_monitor``
    (and ``Node.start_api_server``) with no-ops for the duration of ``ray.init``. Missing: both start."""
    try:
        from ray._private.node import Node
    except ImportError:
        yield
        return
    patched = {"start_monitor": lambda self: None}
    if not api_server:
        patched["start_api_server"] = lambda self, **kwargs: None
    saved = {name: getattr(Node, name) for name in patched if callable(getattr(Node, name, None))}
    try:
        for name in saved:
            setattr(Node, name, patched[name])
        with _own_session():
            yield
    finally:
        for name, method in saved.items():
            setattr(Node, name, method)


@contextlib.contextmanager
def _own_session():
    """The local Ray's processes (GCS, raylet and the workers it starts) in a session of their own, so a
    SIGTERM or SIGHUP to the driver's process group (a terminal closed, a job scheduler's stop) reaches the
    driver alone, which then stops the run at a checkpoint; Ray's own processes would otherwise die at once
    and the driver wait 60 s for a GCS that is gone. Only where the kernel ties them to the driver
    (``PR_SET_PDEATHSIG``: they still die with it). Through ``ray._private.services.ConsolePopen``; missing:
    they stay in the driver's group, as Ray starts them."""
    try:
        from ray._private import services, utils
    except ImportError:
        yield
        return
    base = getattr(services, "ConsolePopen", None)
    if base is None or not sys.platform.startswith("linux") or not utils.detect_fate_sharing_support():
        yield
        return

    class OwnSessionPopen(base):
        def __init__(self, *args, **kwargs):
            kwargs.setdefault("start_new_session", True)
            super().__init__(*args, **kwargs)

    services.ConsolePopen = OwnSessionPopen
    try:
        yield
    finally:
        services.ConsolePopen = base


class WorkerLogStream:
    """Calls ``on_line`` whenever Ray streams worker output to this driver (Ray's stdstream dispatcher).
    Missing: ``active`` is False and nothing is called."""

    HANDLER = "ray_app_worker_logs"

    def __init__(self, on_line: Callable[[object], None]):
        try:
            from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher

            dispatcher.add_handler(self.HANDLER, on_line)
            self._dispatcher = dispatcher
        except Exception:  # a Ray refactor must never break a run
            self._dispatcher = None

    @property
    def active(self) -> bool:
        return self._dispatcher is not None

    def close(self) -> None:
        if self._dispatcher is not None:
            self._dispatcher.remove_handler(self.HANDLER)
            self._dispatcher = None


# ---------------------------------------------------------------- Ray's key-value store (GCS)


def _kv():
    try:
        from ray.experimental import internal_kv
    except ImportError as exc:
        raise RaySeamBroken(f"Ray's internal key-value store is gone ({exc}); run `make check-ray`") from None
    return internal_kv


def stop_key(job_id: str) -> bytes:
    """Where a driver's stop request for its job's workers lives in Ray's key-value store."""
    return f"ray_app:stop:{job_id}".encode()


def kv_put(key: bytes, value: bytes) -> None:
    _kv()._internal_kv_put(key, value, overwrite=True)


def kv_get(key: bytes) -> bytes | None:
    return _kv()._internal_kv_get(key)


def kv_del(key: bytes) -> None:
    _kv()._internal_kv_del(key)


def draining_nodes() -> dict:
    """The node ids Ray is draining (its drain notice). Missing: none, so no drain is seen."""
    try:
        from ray._private.state import state
    except ImportError:
        return {}
    return state.get_draining_nodes() or {}


# ---------------------------------------------------------------- workers


def worker_callback_base():
    """Ray Train V2's ``WorkerCallback`` (its ``after_init_train_context`` runs in every worker's main
    thread at each start). Missing: None, and the kit installs no callback."""
    try:
        from ray.train.v2._internal.execution.callback import WorkerCallback
    except ImportError:
        return None
    return WorkerCallback


def worker_group_callback_base():
    """Ray Train V2's ``WorkerGroupCallback`` (``after_worker_group_start(worker_group)`` runs in the
    controller). Missing: None, and the kit installs no such callback."""
    try:
        from ray.train.v2._internal.execution.callback import WorkerGroupCallback
    except ImportError:
        return None
    return WorkerGroupCallback


def placement_group_of(worker_group):
    """The placement group a started worker group holds (its state's handle)."""
    return worker_group.get_worker_group_state().placement_group_handle.placement_group


CREDENTIAL_ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SECURITY_TOKEN", "AWS_SESSION_TOKEN")


def tune_without_credential_copies() -> list[str]:
    """Tune copies the driver's AWS keys into every trial actor's runtime_env, which Ray writes into its
    runtime-env agent's log and the actor's command line. A trial needs no copy: on a local Ray it inherits
    the driver's environment, on a cluster each node has its own (as for ``ray-app train``, where Ray Train
    copies none). Returns the names no longer copied."""
    try:
        from ray.tune.execution import class_cache
    except ImportError:
        return []
    names = getattr(class_cache, "ENV_VARS_TO_PROPAGATE", None)
    if not isinstance(names, set):
        return []
    dropped = [n for n in CREDENTIAL_ENV if n in names]
    names.difference_update(CREDENTIAL_ENV)
    return dropped


def group_torn_down(exc: BaseException) -> bool:
    """``exc`` is Ray Train's own call failing because the worker group is being torn down: an actor of the
    group (the SynchronizationActor a report or barrier waits on) was killed after another rank died. A
    consequence, like a collective's error, not a cause; an actor error from the user's own actors is not this."""
    import os
    import traceback

    from ray.exceptions import RayActorError

    if not isinstance(exc, RayActorError):
        return False
    train_dir = os.sep + os.path.join("ray", "train") + os.sep
    return any(train_dir in frame.filename for frame in traceback.extract_tb(exc.__traceback__))


class _ShownByTheDriver(logging.Filter):
    """Ray Train logs every worker's exception on every attempt; the errors the driver shows itself
    (bad input, the user's own exception with its traceback) are shown there once instead."""

    active = False

    def filter(self, record: logging.LogRecord) -> bool:
        return not (self.active and record.getMessage().startswith("Error in training function"))


SHOWN_BY_THE_DRIVER = _ShownByTheDriver()


def quiet_train_loggers() -> None:
    """Ray Train logs every report of every rank at INFO on a logger named by its file path (so its
    LoggingConfig does not reach it): kept in Ray's log files, off the console. Its error logger gets
    ``SHOWN_BY_THE_DRIVER``. Missing: both stay as Ray has them."""
    try:
        from ray.train.v2._internal import util as train_util
        from ray.train.v2._internal.execution import context as train_context

        logging.getLogger(train_context.__file__).setLevel(logging.WARNING)
        logging.getLogger(train_util.__name__).addFilter(SHOWN_BY_THE_DRIVER)
    except Exception:  # a Ray refactor must never break training
        pass


# ---------------------------------------------------------------- Ray Train's controller actor


def failure_policy_base():
    """(DefaultFailurePolicy, FailureDecision, is_preemption_failure) of Ray Train V2."""
    try:
        from ray.train.v2._internal.execution.failure_handling import DefaultFailurePolicy, FailureDecision
    except ImportError as exc:
        raise RaySeamBroken(f"Ray Train's failure policy is gone ({exc}); the kit needs Ray Train V2 as in "
                            "Ray 2.60: pip install 'ray[train,default]==2.60.*' (`make check-ray` lists what broke)") from None
    try:
        from ray.train.v2._internal.execution.failure_handling.default import _is_preemption_failure
    except ImportError:
        def _is_preemption_failure(error) -> bool:
            return False
    return DefaultFailurePolicy, FailureDecision, _is_preemption_failure


def restarts_so_far(policy) -> tuple[int, int]:
    """(worker-group failures, controller failures) Ray Train's default policy has counted."""
    return getattr(policy, "_worker_group_failures", 0), getattr(policy, "_controller_failures", 0)


def startup_timeout_error():
    """Ray Train's ``WorkerGroupStartupTimeoutError`` (a group that did not start); missing: a class no
    error is an instance of."""
    try:
        from ray.train.v2._internal.exceptions import WorkerGroupStartupTimeoutError
    except ImportError:
        class WorkerGroupStartupTimeoutError(Exception):
            pass
    return WorkerGroupStartupTimeoutError


def scaling_policy_bases():
    """(FixedScalingPolicy, ElasticScalingPolicy) of Ray Train V2; (None, None) when gone (the kit then
    leaves Ray's policies as they are)."""
    try:
        from ray.train.v2._internal.execution.scaling_policy.elastic import ElasticScalingPolicy
        from ray.train.v2._internal.execution.scaling_policy.fixed import FixedScalingPolicy
    except ImportError:
        return None, None
    return FixedScalingPolicy, ElasticScalingPolicy


class _NoCoordinator:
    """Stands where Ray Train's coordinator client would: sends nothing (no autoscaler would read it)."""

    def maybe_send_resource_request(self, *args, **kwargs) -> None:
        pass

    def send_resource_request(self, *args, **kwargs) -> None:
        pass

    def cancel_resource_request(self) -> None:
        pass


def without_autoscaler(policy):
    """Ray's fixed-size policy with its ``_coordinator_client`` replaced by one that sends nothing; any
    other policy unchanged."""
    fixed, _ = scaling_policy_bases()
    if fixed is None or type(policy) is not fixed:
        return policy

    class FixedPolicyWithoutAutoscaler(fixed):
        def after_controller_start(self, train_run_context) -> None:
            self._coordinator_client = _NoCoordinator()

    return FixedPolicyWithoutAutoscaler(policy.scaling_config)


def elastic_with_limit(policy, limiter_factory):
    """Ray's elastic policy with the kit's ``limiter`` (``limiter_factory(scaling_config)``) consulted on
    each count of the workers the view has room for (the private ``_count_possible_workers``) and told of
    each controller state; any other policy unchanged. The limiter has ``limit(count, nodes)`` and
    ``on_state(state, nodes)``; ``nodes`` are the keys of the policy's latest reserved resources."""
    _, elastic = scaling_policy_bases()
    if elastic is None or type(policy) is not elastic:
        return policy

    class ElasticPolicyHook(elastic):
        def __init__(self, scaling_config):
            super().__init__(scaling_config)
            self.limiter = limiter_factory(scaling_config)

        def after_controller_state_update(self, previous_state, current_state) -> None:
            super().after_controller_state_update(previous_state, current_state)
            self.limiter.on_state(current_state, getattr(self, "_latest_reserved_resources", None))

        def _count_possible_workers(self, reserved_resources) -> int:
            return self.limiter.limit(super()._count_possible_workers(reserved_resources), reserved_resources)

    return ElasticPolicyHook(policy.scaling_config)


def address_and_port():
    """Ray Train's ``get_address_and_port`` (rank 0's address and a free port), run on a worker."""
    from ray.train._internal.utils import get_address_and_port

    return get_address_and_port()


def torch_framework():
    """Ray Train V2's ``TrainingFramework.TORCH`` (what a backend config names as its framework)."""
    from ray.train.v2._internal.util import TrainingFramework

    return TrainingFramework.TORCH


# ---------------------------------------------------------------- driver: TorchTrainer's private hooks

TRAINER_HOOKS = ("_create_default_callbacks", "_register_sigint_handler", "_initialize_and_run_controller")


def trainer_class(dropped_callbacks: tuple[str, ...], failure_policy, scaling_policy):
    """``TorchTrainer`` with the kit's overrides of its private hooks:

    - ``_create_default_callbacks``: without the callbacks named in ``dropped_callbacks`` (each one more
      Ray actor at start-up; ``DatasetsCallback`` is kept when the trainer has datasets);
    - ``_register_sigint_handler``: Ray's only when ``kit_handles_sigint`` is False (else the kit's
      SIGINT checkpoints first);
    - ``_initialize_and_run_controller``: the controller gets ``failure_policy(failure_config,
      **failure_policy_kwargs)`` (a per-run instance, pickled to the controller with its attributes) and
      ``scaling_policy(policy, trainer)`` in place of Ray's.

    Missing hooks: ``RaySeamBroken`` naming them (the kit does not run without its failure policy)."""
    from ray.train.torch import TorchTrainer

    missing = [h for h in TRAINER_HOOKS if not callable(getattr(TorchTrainer, h, None))]
    if missing:
        import ray

        raise RaySeamBroken(f"Ray {ray.__version__}'s TorchTrainer has no {', '.join(missing)}: the kit needs "
                            "Ray Train V2 as in Ray 2.60 (pip install 'ray[train,default]==2.60.*'; "
                            "`make check-ray` lists what broke)")

    class LeanTorchTrainer(TorchTrainer):
        without_autoscaler = False  # set for a Ray the kit started itself: nothing to ask for resources
        kit_handles_sigint = False  # set where the driver's SIGINT checkpoints first (ray_app.worker.preemption)
        poll_when_busy = None  # ray_app.driver.launcher.BusyPolling: the controller's poll, fast only while reports come
        failure_policy_kwargs: dict = {}  # keyword arguments the kit's failure policy is built with

        def _create_default_callbacks(self):
            callbacks = super()._create_default_callbacks()
            drop = set(dropped_callbacks) - ({"DatasetsCallback"} if self.datasets else set())
            return [cb for cb in callbacks if type(cb).__name__ not in drop]

        def _register_sigint_handler(self, controller):
            if not self.kit_handles_sigint:
                super()._register_sigint_handler(controller)

        def _initialize_and_run_controller(self, **kwargs):
            kwargs["failure_policy"] = failure_policy(self.run_config.failure_config, **self.failure_policy_kwargs)
            if "scaling_policy" in kwargs:
                kwargs["scaling_policy"] = scaling_policy(kwargs["scaling_policy"], self)
            with _controller_class(self.poll_when_busy):
                return super()._initialize_and_run_controller(**kwargs)

    return LeanTorchTrainer


@contextlib.contextmanager
def _controller_class(poll):
    """Ray Train's controller actor, polling by ``poll`` (``ray_app.driver.launcher.BusyPolling``) where one is given:
    ``_initialize_and_run_controller`` starts the class its module names ``TrainController``, which is
    replaced for the call. Without the hook (``polling_controller``): Ray's fixed interval."""
    if poll is None or _has("ray.train.v2.api.data_parallel_trainer", "TrainController._poll_workers")():
        yield
        return
    import ray.train.v2.api.data_parallel_trainer as dpt

    base = dpt.TrainController

    class TrainController(base):  # Ray's name: its processes and log lines keep it ("(TrainController pid=...)")
        async def _poll_workers(self):
            status = await super()._poll_workers()
            self._health_check_interval_s = poll.after(status.worker_statuses.values())
            return status

    dpt.TrainController = TrainController
    try:
        yield
    finally:
        dpt.TrainController = base


def main() -> int:
    """``make check-ray``: each assumption against the installed Ray; exit 1 naming each that broke."""
    import ray

    bad = dict((a.item, problem) for a, problem in broken())
    for a in ASSUMPTIONS:
        status = f"BROKEN: {bad[a.item]}; without it {a.without_it}" if a.item in bad else "ok"
        print(f"{a.item:30s} {a.relies_on}\n{'':30s} {status}")
    print(f"Ray {ray.__version__}: {len(ASSUMPTIONS) - len(bad)} of {len(ASSUMPTIONS)} assumptions hold")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
