"""MLflow tracking from rank 0: params, metrics, system metrics, artifacts, the model.

The default store is SQLite inside the run directory (``sqlite:///<run_dir>/mlflow.db``);
any server URI works through ``tracking.uri``. Metrics go to a local journal
(``<run_dir>/mlflow_pending.jsonl``) first and are sent from there; when the tracking server
cannot be reached the run goes on, the journal keeps every metric (across restarts too),
and the next successful contact sends the backlog, in step order, then empties the journal.
The log says which of the two happened. A resumed run continues its MLflow run.

A full disk is not an unreachable server: a store that reports it (SQLite's "database or
disk is full", ENOSPC from an artifact copy or from the journal) stops the run with one
line naming the store or file (:func:`core.errors.no_space`); checkpoints are kept.

A Ctrl-C waits for the store call under way to end (:func:`interrupts_held`): no call is
cut part way, and the run is then marked FAILED.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.config import InvalidValue
from core.errors import RunError, first_line, full_disk_stops

log = logging.getLogger(__name__)


@dataclass
class TrackingConfig:
    """``tracking.*``."""

    enabled: bool = True  # track the run in MLflow (rank 0)
    uri: str = ""  # "" = sqlite:///<run_dir>/mlflow.db; or http://host:port
    experiment: str = "contrastive-pretraining"  # MLflow experiment name
    registered_model: str = ""  # "" = "<run name>-encoder"
    system_metrics: bool = True  # CPU/GPU/memory sampled by MLflow during the run
    log_model: bool = True  # log and register the encoder at the end
    retry_every_s: float = 30.0  # seconds between contact attempts while unreachable
    request_timeout_s: float = 5.0  # seconds before a tracking request counts as failed

    def validate(self) -> None:
        if self.retry_every_s < 0 or self.request_timeout_s <= 0:
            raise InvalidValue("retry_every_s", "retry_every_s >= 0, request_timeout_s > 0")


KEPT = "every checkpoint written so far is kept and the same command resumes from the newest"
RUN_ID_FILE = "mlflow_run_id"  # in the run directory: the run's MLflow run id


class _NoStoreTracebacks(logging.Filter):
    """Drops MLflow's own traceback of a failed store query: the caller reports the fault
    in one line (a warning while the store is unreachable, :func:`core.errors.no_space`
    when it is full)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.exc_info is None and "exception is caught" not in record.getMessage()


@contextmanager
def interrupts_held() -> Iterator[None]:
    """SIGINT held until the block ends, then raised again for the handler it would have
    reached (on the main thread; elsewhere no signal lands)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: held.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if held:
            signal.raise_signal(signal.SIGINT)


def quiet_store_errors() -> None:
    """Install :class:`_NoStoreTracebacks` on MLflow's SQL store logger (once)."""
    store_log = logging.getLogger("mlflow.store.db.utils")
    if not any(isinstance(f, _NoStoreTracebacks) for f in store_log.filters):
        store_log.addFilter(_NoStoreTracebacks())


def run_id_of(run_dir: Path) -> str | None:
    """The MLflow run id a training run in ``run_dir`` logged to, if any."""
    path = run_dir / RUN_ID_FILE
    return path.read_text().strip() if path.is_file() else None


def tracking_uri(cfg: TrackingConfig, run_dir: Path) -> str:
    return cfg.uri or f"sqlite:///{(run_dir / 'mlflow.db').resolve()}"


def experiment_id(client: Any, name: str, artifact_location: str | None = None) -> str:
    """The id of experiment ``name``, created (with ``artifact_location``) if missing."""
    experiment = client.get_experiment_by_name(name)
    if experiment is not None:
        return experiment.experiment_id
    return client.create_experiment(name, artifact_location)


class Tracker:
    """Rank 0's MLflow run; every call survives an unreachable server."""

    def __init__(self, cfg: TrackingConfig, run_dir: Path, run_name: str) -> None:
        import mlflow

        self.cfg, self.run_dir, self.run_name = cfg, run_dir, run_name
        self.uri = tracking_uri(cfg, run_dir)
        quiet_store_errors()
        if self.uri.startswith("http"):  # fail fast instead of MLflow's minutes of retries
            os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] = "0"
            os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] = str(int(cfg.request_timeout_s))
        self.client = mlflow.MlflowClient(tracking_uri=self.uri, registry_uri=self.uri)
        self.journal = run_dir / "mlflow_pending.jsonl"
        self.run_id = run_id_of(run_dir)
        self.params: dict[str, str] = {}
        self.monitor = None
        self.last_try = -float("inf")
        self.reachable: bool | None = None

    # -- connection -----------------------------------------------------------------
    def _ensure_run(self) -> None:
        if self.run_id is None:
            # the embedded store keeps its artifacts in the run directory too
            location = None if self.cfg.uri else (self.run_dir / "mlartifacts").resolve().as_uri()
            experiment = experiment_id(self.client, self.cfg.experiment, location)
            self.run_id = self.client.create_run(experiment,
                                                 run_name=self.run_name).info.run_id
            (self.run_dir / RUN_ID_FILE).write_text(self.run_id)
        if self.params:
            self._log_params()
        if self.cfg.system_metrics and self.monitor is None:
            from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

            self.monitor = SystemMetricsMonitor(self.run_id, tracking_uri=self.uri,
                                                resume_logging=True)
            self.monitor.start()

    def _log_params(self) -> None:
        """The run's configuration as params. A resumed run logs the keys its run lacks;
        MLflow keeps a param's first value, so a changed value is recorded as the tag
        ``changed.<key>`` ("old -> new") and named in one warning."""
        from mlflow.entities import Param

        logged = self.client.get_run(self.run_id).data.params
        params = {k: v[:6000] for k, v in self.params.items()}
        changed = {k: f"{logged[k]} -> {v}" for k, v in params.items()
                   if k in logged and logged[k] != v}
        items = [Param(k, v) for k, v in params.items() if k not in logged]
        for i in range(0, len(items), 100):
            self.client.log_batch(self.run_id, params=items[i:i + 100])
        for key, change in changed.items():
            self.client.set_tag(self.run_id, f"changed.{key}", change[:5000])
        if changed:
            log.warning("tracking: this run changes %d logged params of MLflow run %s (tags "
                        "changed.*): %s", len(changed), self.run_id,
                        ", ".join(f"{k}: {v}" for k, v in changed.items()))
        self.params = {}

    @contextmanager
    def _store_call(self) -> Iterator[None]:
        """Around every store call: a full disk stops the run, a Ctrl-C waits for the call."""
        with interrupts_held(), full_disk_stops("to the MLflow tracking store", self.uri,
                                                "tracking.uri", KEPT):
            yield

    def _contact(self, force: bool = False) -> bool:
        """Try to reach the server (at most every retry_every_s) and send the backlog."""
        if not force and self.reachable is False and \
                time.monotonic() - self.last_try < self.cfg.retry_every_s:
            return False
        self.last_try = time.monotonic()
        try:
            with self._store_call():
                self._ensure_run()
                sent = self._send_journal()
        except RunError:
            raise
        except Exception as err:  # unreachable or failing server: keep going, keep data
            if self.reachable is not False:
                log.warning("tracking: %s unreachable (%s); training goes on, metrics kept "
                            "in %s and sent when it is back", self.uri,
                            first_line(err, 160), self.journal)
            self.reachable = False
            return False
        if self.reachable is False:
            log.warning("tracking: %s is back; sent %d buffered metric rows", self.uri, sent)
        self.reachable = True
        return True

    def _send_journal(self) -> int:
        if not self.journal.is_file():
            return 0
        from mlflow.entities import Metric

        rows = []
        for line in self.journal.read_text().splitlines():
            if not line:
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:  # a row cut by a crash or Ctrl-C while written
                log.warning("tracking: a cut row of %s passed over", self.journal)
        metrics = [Metric(k, float(v), int(row["t"]), int(row["step"]))
                   for row in rows for k, v in row["metrics"].items()]
        for i in range(0, len(metrics), 1000):
            self.client.log_batch(self.run_id, metrics=metrics[i:i + 1000])
        self.journal.unlink()
        return len(rows)

    # -- logging --------------------------------------------------------------------
    def start(self, params: dict[str, Any]) -> None:
        self.params = {k: str(v) for k, v in params.items()}
        self._contact(force=True)

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        row = {"step": step, "t": int(time.time() * 1000), "metrics": metrics}
        with full_disk_stops("the metric journal", self.journal, "output_dir", KEPT), \
                open(self.journal, "a") as f:
            f.write(json.dumps(row) + "\n")
        self._contact()

    def log_artifact(self, path: Path, artifact_path: str | None = None) -> None:
        if self._contact(force=True):
            try:
                with self._store_call():
                    self.client.log_artifact(self.run_id, str(path), artifact_path)
            except RunError:
                raise
            except Exception as err:
                log.warning("tracking: artifact %s not logged (%s)", path, err)

    def set_tag(self, key: str, value: str) -> None:
        """A tag on the run now; a store that cannot be reached is named in a warning."""
        if self._contact(force=True):
            try:
                with self._store_call():
                    self.client.set_tag(self.run_id, key, value)
                return
            except RunError:
                raise
            except Exception as err:
                log.warning("tracking: tag %s not set (%s)", key, err)

    def log_model(self, register: Callable[[str, str], str]) -> str | None:
        """Register the encoder through ``register(tracking_uri, run_id) -> version`` (the
        app passes :func:`registry.versions.log_encoder` with the model, card and
        configuration bound); returns the version, or None when the server is
        unreachable."""
        if not self._contact(force=True):
            return None
        with self._store_call():
            return register(self.uri, self.run_id)

    def finish(self, status: str = "FINISHED", tags: dict[str, str] | None = None) -> None:
        """End the run with ``status`` (FINISHED, FAILED, KILLED), setting ``tags`` first.
        Ending a run that stopped on a fault (any status but FINISHED) never raises: that
        fault is the one to report, and a store that fails now is named in a warning."""
        try:
            self._finish(status, tags)
        except Exception as err:
            if status == "FINISHED":
                raise
            log.warning("tracking: MLflow run %s not marked %s (%s)", self.run_id, status,
                        first_line(err, 300))

    def _finish(self, status: str, tags: dict[str, str] | None) -> None:
        if self.monitor is not None:
            self.monitor.finish()
            self.monitor = None
        # a run that stopped on a fault is marked even when its backlog cannot be sent
        if self._contact(force=True) or (status != "FINISHED" and self.run_id is not None):
            with self._store_call():
                for key, value in (tags or {}).items():
                    self.client.set_tag(self.run_id, key, value)
                self.client.set_terminated(self.run_id, status)
        else:
            log.warning("tracking: %s still unreachable at the end; %s holds the unsent "
                        "metrics (sent by the next run resuming in %s)", self.uri,
                        self.journal, self.run_dir)
