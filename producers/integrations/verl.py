"""verl (0.9.1): its ``Tracking`` logger hook, or the JSONL its ``file`` backend writes.

verl logs through ``verl.utils.tracking.Tracking``: ``trainer.logger=[...]`` names its backends,
each an object with ``log(data=..., step=...)`` and ``finish()``. The set is closed: ``Tracking``
asserts each name is in its ``supported_backend`` list and builds them in a fixed chain, with no
registry or entry point. So a backend of ours is added to the class in the process that builds
the ``Tracking`` (the PPO trainer's TaskRunner, a Ray actor), with a Ray setup hook, and named
like verl's own::

    python -m verl.trainer.main_ppo ... trainer.logger='[console,rlpulse]' \\
        +ray_kwargs.ray_init.runtime_env.worker_process_setup_hook=rlpulse.producers.integrations.verl.install

The run is ``trainer.project_name`` / ``trainer.experiment_name``; its settings (RUN_START's ``config``)
are the config verl hands ``Tracking`` (its whole OmegaConf config, resolved). verl's PPO trainer (v1, the
default) ends its ``Tracking`` with ``finish(exit_code=0 or 1)``: RUN_END is finished or failed.

Other ways in: ``attach(tracking, tel)`` adds the backend to a ``Tracking`` you hold; and
``follow_file(path, tel)`` publishes what the ``file`` backend writes (one JSON object a line,
``{"step": n, "data": {...}}``, at ``file_logger_path(project, experiment)``), from any process.

Prompts and completions (content on: ``install(content=True)`` or ``RLPULSE_TRACE_CONTENT=1``; and
``trainer.rollout_data_dir``): ``register_trainer`` patches ``_log_rollout_data`` and the
``_dump_generations(inputs, outputs, gts, scores, ...)`` it calls (legacy ``RayPPOTrainer``, v1
``PPOTrainer``): each rollout of a training dump gets a ROLLOUT span and an LLM span ``verl.generate``
(``rlpulse.producers.integrations.completions``); validation dumps are left out.

Step mapping: the step is verl's ``global_steps`` as logged (1 for the first training step; 0
for the validation before training). A dict of validation figures only (``val-core/``,
``val-aux/``, ``val/``) goes out as METRICS of its step; any other dict completes its step (STEP,
once per step) with ``timing_s/step`` as its duration, ``perf/total_num_tokens`` as tokens and
``perf/mfu/actor`` (SFT: ``train/mfu``) as MFU, a fraction as verl computes it (estimated over
promised FLOPs per GPU): a value outside 0 to 1 leaves the STEP's MFU null, with a warning, and
stays a metric. Every number of the dict is a metric under verl's own name. verl makes no grader
calls that rlpulse sees (its reward scores arrive as metrics), so ``grader_calls`` does not apply.
``response_length/clip_ratio`` is the share of responses cut at the length limit (truncation,
the seed's clipped ratio); ``actor/pg_clipfrac`` is PPO's ratio clipping: different figures.
"""

from __future__ import annotations

import functools
import inspect
import json
import logging
import os
import threading
from typing import Any
from collections.abc import Mapping

from rlpulse.producers.integrations.completions import (DEFAULT_CONTENT_LIMIT, Completion, CompletionPublisher,
                                                        completion_publisher, finite)
from rlpulse.producers.integrations.metrics_dict import MetricsPublisher, patch_on_import, send_settings, telemetry_for
from rlpulse.producers.integrations.verl_rollouts import TRAINER_MODULES, current_backends, register_trainer_of
from rlpulse.producers.integrations.verl_rollouts import register_trainer as register_trainer  # part of this module's API
from rlpulse.producers.sdk.telemetry import TrainingTelemetry

log = logging.getLogger(__name__)

BACKEND = "rlpulse"  # the name in trainer.logger
TRACKING_MODULE = "verl.utils.tracking"
VALIDATION_PREFIXES = ("val-", "val/")  # val-core/..., val-aux/... (PPO trainers); val/loss (SFT trainers)
DURATION_KEYS = ("timing_s/step",)
TOKENS_KEYS = ("perf/total_num_tokens", "train/global_tokens")  # PPO; SFT
MFU_KEYS = ("perf/mfu/actor", "train/mfu")
MAX_READ_BYTES = 16 << 20  # of the JSONL per poll: a long file is read in bounded pieces
CONTENT_OPTIONS = ("content", "content_limit", "token_ids")
FACTS = ("sample_ids", "input_tokens", "output_tokens", "prompt_ids", "response_ids")  # of a rollout dump, where known


class VerlLogger:
    """A verl tracking backend: ``Tracking.log`` calls ``log(data=..., step=...)``.

    ``finish(exit_code)`` ends the telemetry when this backend owns it (``install``): RUN_END is
    finished for exit code 0, failed otherwise."""

    def __init__(self, telemetry: TrainingTelemetry, owns_telemetry: bool = False,
                 completions: CompletionPublisher | None = None):
        self.publisher = MetricsPublisher(telemetry, owns_telemetry=owns_telemetry)
        self.completions = completions  # None: content off, no rollout text (and no rollouts) sent

    def generations(self, step: int, inputs: list[Any], outputs: list[Any], scores: list[Any],
                    facts: Mapping[str, list[Any]] | None = None, max_tokens: int | None = None) -> int:
        """Publish a training dump's rollouts (verl's ``_dump_generations`` arguments): ROLLOUT spans and their
        LLM spans. ``facts``: per rollout, ``sample_ids``, ``input_tokens``, ``output_tokens``, ``prompt_ids``,
        ``response_ids`` where known. A rollout without a finite score is left out (logged). Returns LLM spans sent."""
        if self.completions is None or self.publisher.closed:
            return 0
        def column(name: str) -> list[Any]:  # one value per rollout, None where unknown
            given = list((facts or {}).get(name) or ())[:len(inputs)]
            return given + [None] * (len(inputs) - len(given))

        samples, n_in, n_out, p_ids, r_ids = (column(k) for k in FACTS)
        rollouts = [(Completion(f"s{step}-{i}", prompt, output, n_in[i], n_out[i], p_ids[i], r_ids[i]),
                     {"reward": finite(score), "completion_tokens": n_out[i], "max_tokens": max_tokens,
                      "sample_id": None if samples[i] is None else str(samples[i])})
                    for i, (prompt, output, score) in enumerate(zip(inputs, outputs, scores))]
        return self.completions.publish_with_rollouts(step, rollouts)

    def log(self, data: Mapping[str, Any], step: int) -> None:
        if data and all(isinstance(k, str) and k.startswith(VALIDATION_PREFIXES) for k in data):
            self.publisher.scalars(step, data)
        else:
            self.publisher.step(step, data, duration_s=_first(data, DURATION_KEYS), tokens=_first(data, TOKENS_KEYS),
                                mfu=_first(data, MFU_KEYS))

    def finish(self, exit_code: int = 0, collected: bool = False) -> None:
        """``collected``: verl's ``Tracking.__del__`` finished it, with no exit code (its legacy
        trainer, which never calls ``finish``). How the run ended is then unknown: rather than
        a crash reported as finished, no RUN_END is sent (what is buffered is delivered)."""
        publisher = self.publisher
        if self in current_backends:
            current_backends.remove(self)
        if publisher.closed:
            return
        if collected and publisher.owns_telemetry:
            log.info("rlpulse: verl's Tracking was collected without finish(exit_code): no RUN_END is sent, since "
                     "how the run ended is unknown (trainer.use_v1=true ends it with an exit code)")
            publisher.owns_telemetry = False
            publisher.close()
            publisher.telemetry.abandon()
            return
        publisher.close(status="finished" if exit_code == 0 else "failed")


def attach(tracking: Any, telemetry: TrainingTelemetry, owns_telemetry: bool = False, content: bool | None = None,
           content_limit: int = DEFAULT_CONTENT_LIMIT, token_ids: bool = False, model: str | None = None,
           config: Any = None) -> VerlLogger:
    """Add the backend to a ``verl.utils.tracking.Tracking`` already built: ``Tracking.log``
    calls every entry of its ``logger`` dict. ``Tracking.finish`` does not finish it unless
    ``install`` ran in this process; the telemetry's own context manager ends the run.
    ``config``: the config given to the ``Tracking`` (which does not keep it), the run's settings.
    ``content`` (None: ``RLPULSE_TRACE_CONTENT``): this backend publishes the rollouts of the trainer
    classes ``register_trainer`` patched (``install`` does), each content attribute capped at ``content_limit``."""
    send_settings(telemetry, config, "verl")
    completions = completion_publisher(telemetry, "verl.generate", content, content_limit, token_ids, model)
    backend = VerlLogger(telemetry, owns_telemetry=owns_telemetry, completions=completions)
    tracking.logger[BACKEND] = backend
    if completions is not None:
        current_backends[:] = [backend]
    return backend


def install(project: str | None = None, run_id: str | None = None, attempt: int = 1, content: bool | None = None,
            content_limit: int = DEFAULT_CONTENT_LIMIT, token_ids: bool = False, **telemetry_kwargs: Any) -> None:
    """Make ``rlpulse`` a backend name of verl's ``Tracking`` in this process (a Ray
    ``worker_process_setup_hook``; harmless in processes that never build a ``Tracking``).

    A ``Tracking`` built with ``rlpulse`` among its backends gets a ``VerlLogger`` with its own
    ``TrainingTelemetry``: ``project`` or verl's project name, ``run_id`` or its experiment name,
    trainer ``sft`` for a config without ``actor_rollout_ref``, rank 0 (verl builds ``Tracking``
    in the one process that logs). ``telemetry_kwargs`` go to ``TrainingTelemetry``; ``content``,
    ``content_limit`` and ``token_ids`` to ``attach`` (the trainer classes are patched for them too).
    The class is patched once verl imports it, never before (``patch_on_import`` says why)."""
    options = dict(project=project, run_id=run_id, attempt=attempt, content=content, content_limit=content_limit,
                   token_ids=token_ids, **telemetry_kwargs)
    patch_on_import(TRACKING_MODULE, lambda module: register(module.Tracking, options))
    for name, cls in TRAINER_MODULES.items():
        if content is not False:  # the trainers' dump hooks pass through unless a backend with content on exists
            patch_on_import(name, functools.partial(register_trainer_of, cls))


def register(tracking_class: Any, options: Mapping[str, Any] | None = None) -> None:
    """Patch ``tracking_class`` (verl's ``Tracking``) as ``install`` describes; idempotent."""
    if getattr(tracking_class, "_rlpulse_options", None) is not None:
        tracking_class._rlpulse_options = dict(options or {})
        return
    tracking_class._rlpulse_options = dict(options or {})
    if BACKEND not in tracking_class.supported_backend:
        tracking_class.supported_backend.append(BACKEND)  # verl asserts each name of trainer.logger is listed
    init, finish, delete = tracking_class.__init__, tracking_class.finish, getattr(tracking_class, "__del__", None)
    signature = inspect.signature(init)

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        arguments = signature.bind(self, *args, **kwargs)
        arguments.apply_defaults()
        given = dict(arguments.arguments)
        backends = given.get("default_backend") or ()
        if BACKEND not in ([backends] if isinstance(backends, str) else list(backends)):
            return
        options = type(self)._rlpulse_options
        try:
            telemetry = _telemetry(options, given)
            send_settings(telemetry, given.get("config"), "verl")  # before start: on the first RUN_START
            telemetry.start()
        except Exception:  # a name the SDK refuses, a bad setting: the training runs on without telemetry
            log.exception("rlpulse: no telemetry for this verl run")
            return
        content = {k: options[k] for k in CONTENT_OPTIONS if k in options}
        try:
            attach(self, telemetry, owns_telemetry=True, model=_model(given.get("config")), **content)
        except ValueError:  # a bad content switch or limit: the figures still go out, without text
            log.exception("rlpulse: no rollout text for this verl run")
            attach(self, telemetry, owns_telemetry=True, content=False)

    @functools.wraps(finish)
    def finish_(self: Any, exit_code: int = 0) -> None:
        backend = getattr(self, "logger", {}).get(BACKEND)
        try:
            finish(self, exit_code=exit_code)
        finally:
            if isinstance(backend, VerlLogger):
                backend.finish(exit_code, collected=getattr(self, "_rlpulse_collected", False))

    def __del__(self: Any) -> None:
        self._rlpulse_collected = True  # finish() reached from here had no exit code
        if delete is not None:
            delete(self)
        else:
            finish_(self)

    tracking_class.__init__, tracking_class.finish, tracking_class.__del__ = __init__, finish_, __del__


def _telemetry(options: Mapping[str, Any], given: Mapping[str, Any]) -> TrainingTelemetry:
    config = given.get("config")
    rl = not isinstance(config, Mapping) or "actor_rollout_ref" in config  # PPO configs have it, SFT configs do not
    kwargs = {k: val for k, val in options.items() if k not in ("project", "run_id", *CONTENT_OPTIONS)}
    kwargs.setdefault("trainer", "rl" if rl else "sft")
    kwargs.setdefault("rank", 0)
    kwargs.setdefault("world_size", 1)
    project, run_id = options.get("project") or given.get("project_name"), options.get("run_id") or given.get("experiment_name")
    if project is None or run_id is None:
        raise ValueError("no run to publish to: give Tracking a project and experiment name, or install() a project and run_id")
    return telemetry_for(project, run_id, **kwargs)


def _model(config: Any) -> str | None:
    try:
        path = config["actor_rollout_ref"]["model"]["path"]
    except (KeyError, TypeError, IndexError):
        return None
    return path if isinstance(path, str) else None


def _first(data: Mapping[str, Any], keys: tuple[str, ...]) -> Any:
    for key in keys:
        if key in data:
            return data[key]
    return None


# -- the file backend's JSONL ----------------------------------------------------------------
def file_logger_path(project_name: str, experiment_name: str, env: Mapping[str, str] | None = None) -> str:
    """Where verl's ``file`` backend writes: VERL_FILE_LOGGER_PATH, else
    ``$VERL_FILE_LOGGER_ROOT/<project>/<experiment>.jsonl`` (the root defaults to the working folder)."""
    env = os.environ if env is None else env
    if env.get("VERL_FILE_LOGGER_PATH"):
        return env["VERL_FILE_LOGGER_PATH"]
    root = os.path.expanduser(env.get("VERL_FILE_LOGGER_ROOT", "."))
    return os.path.join(root, project_name, f"{experiment_name}.jsonl")


class FileFollower:
    """Publishes the records verl's ``file`` backend appends to ``path``: by hand (``poll``) or
    from a thread (``start``/``stop``, or ``with``). The file may not exist yet. verl opens it
    with ``wb``: a file that shrank or was replaced is read again from its start.

    How the run ended is not in the file: the telemetry's owner ends it (its context manager)."""

    def __init__(self, path: str | os.PathLike[str], telemetry: TrainingTelemetry, poll_s: float = 0.5):
        self.path = os.fspath(path)
        self.logger = VerlLogger(telemetry)
        self.poll_s = poll_s
        self.records = 0  # lines published
        self.bad_lines = 0  # lines that are not a {"step": int, "data": {...}} object (logged)
        self._offset, self._pending = 0, b""
        self._inode: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # poll() from the thread and from stop()

    def poll(self) -> int:
        """Publish the complete lines written since the last poll; returns how many."""
        with self._lock:
            return self._poll()

    def start(self) -> FileFollower:
        if self._thread is not None:
            return self
        self._thread = threading.Thread(target=self._run, name="rlpulse-verl-file", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the thread, then publish what is left, a last line without its newline included."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        with self._lock:
            offset = -1
            while offset != self._offset:  # a long file: in MAX_READ_BYTES pieces
                offset = self._offset
                self._poll()
            if self._pending.strip():
                self._line(self._pending)
            self._pending = b""
        self.logger.publisher.close()

    def __enter__(self) -> FileFollower:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.poll()
            except OSError as exc:  # the folder went away, a permission: try again next time
                log.warning("rlpulse: cannot read %s: %s", self.path, exc)

    def _poll(self) -> int:
        try:
            with open(self.path, "rb") as f:
                st = os.fstat(f.fileno())
                if self._inode is not None and (st.st_ino != self._inode or st.st_size < self._offset):
                    log.info("rlpulse: %s was rewritten; reading it from the start", self.path)
                    self._offset, self._pending = 0, b""
                self._inode = st.st_ino
                f.seek(self._offset)
                chunk = f.read(min(st.st_size - self._offset, MAX_READ_BYTES))
        except FileNotFoundError:
            return 0
        self._offset += len(chunk)
        lines = (self._pending + chunk).split(b"\n")
        self._pending = lines.pop()  # an unfinished line waits for its newline
        return sum(self._line(line) for line in lines if line.strip())

    def _line(self, line: bytes) -> int:
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if not (isinstance(record, dict) and isinstance(record.get("data"), dict)
                and type(record.get("step")) is int and record["step"] >= 0):
            self.bad_lines += 1
            log.warning("rlpulse: %s: a line that is not verl's {\"step\": n, \"data\": {...}} is not sent: %.120r",
                        self.path, line)
            return 0
        self.logger.log(record["data"], record["step"])
        self.records += 1
        return 1


def follow_file(path: str | os.PathLike[str], telemetry: TrainingTelemetry, poll_s: float = 0.5) -> FileFollower:
    """A started ``FileFollower``: ``with TrainingTelemetry(...) as tel, follow_file(path, tel): run verl``."""
    return FileFollower(path, telemetry, poll_s).start()


def replay_file(path: str | os.PathLike[str], telemetry: TrainingTelemetry) -> int:
    """Publish a finished run's whole file now; returns the lines published."""
    follower = FileFollower(path, telemetry)
    follower.stop()
    return follower.records
