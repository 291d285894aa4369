"""Prometheus metrics of the Neuron plugin (``vllm_neuron:*``), in multiprocess mode.

The metrics (reference neuron.md §2.5; features guide "Metrics"):

============================================  =========  ==========================  =========
name                                          type       labels                      buckets
============================================  =========  ==========================  =========
``vllm_neuron:num_seqs_padding``              Histogram  model_name, bucket_name,    1..128
                                                         rank_id                     (2**0..7)
``vllm_neuron:num_batched_tokens_padding``    Histogram  model_name, bucket_name,    32..16384
                                                         rank_id                     (2**5..14)
``vllm_neuron:neff_execution_count``          Counter    model_name, bucket_name,    -
                                                         rank_id
``vllm_neuron:compilation_time_seconds``      Gauge max  model_name, bucket_name,    -
                                                         rank_id
``vllm_neuron:startup_time_seconds``          Gauge max  model_name, rank_id         -
``vllm_neuron:model_load_time_seconds``       Gauge max  model_name, rank_id         -
``vllm_neuron:model_load_size_bytes``         Gauge sum  model_name, rank_id         -
============================================  =========  ==========================  =========

``rank_id`` is on **every** metric: the features guide lists it under "Common labels" next to
``model_name`` and ``bucket_name`` ("Process local rank ID (relative to start rank)"). With it a
TP/DP rank's gauges stay separate series instead of being folded by ``max``/``sum`` across
processes (the ``sum`` of ``model_load_size_bytes`` then only adds up the processes of one
rank, e.g. a restarted worker; summing across ranks is a PromQL ``sum by (model_name)``).
Counter and histogram series of processes with the same labels are summed by the collector.

How vLLM 0.32 exposes them (read in ``vllm/v1/metrics/prometheus.py`` and
``vllm/entrypoints/serve/instrumentator/metrics.py``):

* the API server's ``/metrics`` is ``make_asgi_app(registry=get_prometheus_registry())``,
  mounted by ``attach_router`` when the app is built. ``get_prometheus_registry()`` returns a
  **fresh** ``CollectorRegistry`` with a ``multiprocess.MultiProcessCollector`` when
  ``PROMETHEUS_MULTIPROC_DIR`` is set in the API-server process at that moment, else the
  process-global ``REGISTRY``. The collector re-reads every ``*.db`` file of the directory on
  each scrape, so whatever the engine-core process (a child started after the variable is set,
  so it inherits it) and the workers write is exposed, and so is the API server's own vLLM
  metrics, as long as they too were created with the multiprocess value class;
* vLLM sets the variable itself only for ``--api-server-count > 1``
  (``setup_multiprocess_prometheus`` in ``vllm serve``); with one API server and no variable,
  ``/metrics`` is the API process's own ``REGISTRY`` and an engine-core metric is never seen.
  Hence :func:`ensure_multiproc_dir`, called from ``NeuronPlatform.pre_register_and_update``,
  which vLLM runs in the API server (building its argument parser and its engine
  configuration) before it creates its metrics and starts the engine core;
* ``prometheus_client.values.ValueClass`` is chosen once, when ``prometheus_client.values`` is
  first imported, from the environment of that moment. vLLM imports ``prometheus_client``
  early (its entrypoints), so the variable may be set too late for the process that sets it:
  :func:`ensure_multiproc_dir` and :class:`NeuronMetrics` then switch ``ValueClass`` to
  ``MultiProcessValue()`` (the metric classes look ``values.ValueClass`` up at construction),
  so every metric created afterwards, vLLM's included, writes to the directory. A metric
  created before the switch stays in process memory and is invisible to a multiprocess
  ``/metrics``; vLLM creates its own metrics when the engine client is built, after platform
  resolution;
* vLLM's ``shutdown_prometheus`` marks the dead pid only for a directory it created itself;
  live-gauge files of ours are ``max``/``sum`` mode, which the collector aggregates from any
  pid, so a stale directory shows stale values: the guide says to wipe it between restarts.

Metric objects are created once per process (module scope, lazily) in the default registry;
:class:`NeuronMetrics` is a cheap handle binding ``model_name`` and ``rank_id``.
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import tempfile
import threading
from collections.abc import Iterable, MutableMapping
from dataclasses import dataclass

from prometheus_client import Counter, Gauge, Histogram

__all__ = ["MULTIPROC_ENV", "MULTIPROC_PREFIX", "NUM_SEQS_BUCKETS", "NUM_BATCHED_TOKENS_BUCKETS",
           "ensure_multiproc_dir", "ensure_multiprocess_values", "NeuronMetrics"]

logger = logging.getLogger("vllm.vllm_npu.neuron")

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
#: ``tempfile.mkdtemp`` prefix of the directory the plugin creates when the user set none.
MULTIPROC_PREFIX = "vllm_neuron_prometheus_"
#: Histogram boundaries of ``vllm_neuron:num_seqs_padding`` (sequences): 1, 2, ..., 128.
NUM_SEQS_BUCKETS: tuple[float, ...] = tuple(float(2**i) for i in range(8))
#: Histogram boundaries of ``vllm_neuron:num_batched_tokens_padding`` (tokens): 32, ..., 16384.
NUM_BATCHED_TOKENS_BUCKETS: tuple[float, ...] = tuple(float(2**i) for i in range(5, 15))

_BUCKET_LABELS = ("model_name", "bucket_name", "rank_id")
_MODEL_LABELS = ("model_name", "rank_id")


def ensure_multiprocess_values(environ: MutableMapping[str, str] = os.environ) -> bool:
    """Make metrics created from now on use prometheus_client's multiprocess value class.

    A no-op unless ``PROMETHEUS_MULTIPROC_DIR`` (or the legacy lower-case name) is set in
    ``environ``; then ``prometheus_client.values.ValueClass`` is replaced by
    ``MultiProcessValue()`` if ``prometheus_client`` was imported before the variable was set.

    Returns:
        True when multiprocess mode is in effect.
    """
    if MULTIPROC_ENV not in environ and "prometheus_multiproc_dir" not in environ:
        return False
    from prometheus_client import values
    if values.ValueClass is values.MutexValue:
        values.ValueClass = values.MultiProcessValue()
        logger.debug("prometheus_client was imported before %s was set: switched it to "
                     "multiprocess values", MULTIPROC_ENV)
    return True


def ensure_multiproc_dir(environ: MutableMapping[str, str] = os.environ) -> str:
    """Turn on prometheus_client multiprocess mode for this process and its children.

    Keeps a ``PROMETHEUS_MULTIPROC_DIR`` the user set (the directory must exist and should be
    wiped between server restarts, else stale values are exposed); otherwise creates
    ``tempfile.mkdtemp(prefix="vllm_neuron_prometheus_")`` and sets the variable. Idempotent.
    Then :func:`ensure_multiprocess_values`.

    Args:
        environ: the environment to read and update (``os.environ`` in the plugin; children
            started afterwards inherit it).

    Returns:
        The directory.

    Raises:
        OSError: the temporary directory cannot be created.
    """
    path = environ.get(MULTIPROC_ENV)
    if not path:
        path = tempfile.mkdtemp(prefix=MULTIPROC_PREFIX)
        environ[MULTIPROC_ENV] = path
        owner = os.getpid()
        # removed when the process that made it exits (its children, which inherit the
        # variable, exit first: the engine core before the API server)
        atexit.register(lambda: os.getpid() == owner and shutil.rmtree(path, ignore_errors=True))
        logger.debug("Set %s=%s", MULTIPROC_ENV, path)
    ensure_multiprocess_values(environ)
    return path


@dataclass(frozen=True)
class _Metrics:
    num_seqs_padding: Histogram
    num_batched_tokens_padding: Histogram
    neff_execution_count: Counter
    compilation_time_seconds: Gauge
    startup_time_seconds: Gauge
    model_load_time_seconds: Gauge
    model_load_size_bytes: Gauge


_lock = threading.Lock()
_metrics: _Metrics | None = None


def _get_metrics() -> _Metrics:
    """The process's metric objects, created (and registered in ``REGISTRY``) on first use."""
    global _metrics
    with _lock:
        if _metrics is None:
            ensure_multiprocess_values()
            _metrics = _Metrics(
                num_seqs_padding=Histogram(
                    "vllm_neuron:num_seqs_padding",
                    "Padded batch lines, by model_name and bucket_name",
                    labelnames=_BUCKET_LABELS, buckets=NUM_SEQS_BUCKETS),
                num_batched_tokens_padding=Histogram(
                    "vllm_neuron:num_batched_tokens_padding",
                    "Padded sequence length, by model_name and bucket_name",
                    labelnames=_BUCKET_LABELS, buckets=NUM_BATCHED_TOKENS_BUCKETS),
                neff_execution_count=Counter(
                    "vllm_neuron:neff_execution_count",
                    "NEFF executions, by model_name and bucket_name",
                    labelnames=_BUCKET_LABELS),
                compilation_time_seconds=Gauge(
                    "vllm_neuron:compilation_time_seconds",
                    "Graph compilation time, by bucket_name",
                    labelnames=_BUCKET_LABELS, multiprocess_mode="max"),
                startup_time_seconds=Gauge(
                    "vllm_neuron:startup_time_seconds", "Total server startup time",
                    labelnames=_MODEL_LABELS, multiprocess_mode="max"),
                model_load_time_seconds=Gauge(
                    "vllm_neuron:model_load_time_seconds", "Weight load time (host to HBM)",
                    labelnames=_MODEL_LABELS, multiprocess_mode="max"),
                model_load_size_bytes=Gauge(
                    "vllm_neuron:model_load_size_bytes", "Weight size transferred to device",
                    labelnames=_MODEL_LABELS, multiprocess_mode="sum"),
            )
        return _metrics


class NeuronMetrics:
    """The Neuron metrics of one model in one process, labelled ``model_name`` and ``rank_id``.

    Bucket names follow the vendor: ``prefill_s{tokens}`` and ``decode_b{batch}``.

    Args:
        model_name: the served model's name (label value).
        rank_id: the process's local rank (label value; 0 for the engine-core scheduler).
    """

    def __init__(self, model_name: str, rank_id: int = 0) -> None:
        self.model_name = str(model_name)
        self.rank_id = str(int(rank_id))
        self._m = _get_metrics()

    def _bucket(self, bucket_name: str) -> dict[str, str]:
        return {"model_name": self.model_name, "bucket_name": bucket_name, "rank_id": self.rank_id}

    def precreate(self, prefill_bucket_names: Iterable[str], decode_bucket_names: Iterable[str]) -> None:
        """Create the padding histograms' series for every bucket (zero counts) so they are
        exposed before the first step: ``prefill_s*`` names on
        ``num_batched_tokens_padding``, ``decode_b*`` names on ``num_seqs_padding``."""
        for name in prefill_bucket_names:
            self._m.num_batched_tokens_padding.labels(**self._bucket(name))
        for name in decode_bucket_names:
            self._m.num_seqs_padding.labels(**self._bucket(name))

    def observe_prefill(self, padded_tokens: int) -> None:
        """One prefill step padded to ``padded_tokens`` tokens (bucket ``prefill_s{padded}``)."""
        self._m.num_batched_tokens_padding.labels(
            **self._bucket(f"prefill_s{padded_tokens}")).observe(padded_tokens)

    def observe_decode(self, real_count: int, padded_batch: int) -> None:
        """One decode step of ``real_count`` requests, run on the ``padded_batch`` NEFF
        (bucket ``decode_b{padded_batch}``); the observed value is the real count."""
        self._m.num_seqs_padding.labels(**self._bucket(f"decode_b{padded_batch}")).observe(real_count)

    def neff_executed(self, bucket_name: str) -> None:
        """One NEFF execution of ``bucket_name`` (e.g. ``prefill_s1024_kv2048``, ``decode_b3``)."""
        self._m.neff_execution_count.labels(**self._bucket(bucket_name)).inc()

    def compiled(self, bucket_name: str, seconds: float) -> None:
        """``bucket_name``'s graph compiled in ``seconds`` (wall clock)."""
        self._m.compilation_time_seconds.labels(**self._bucket(bucket_name)).set(seconds)

    def startup(self, seconds: float) -> None:
        """Total startup time, seconds, up to the end of warmup."""
        self._m.startup_time_seconds.labels(model_name=self.model_name, rank_id=self.rank_id).set(seconds)

    def model_loaded(self, seconds: float, nbytes: int) -> None:
        """Weights loaded to the device: ``seconds`` of wall clock, ``nbytes`` bytes."""
        labels = {"model_name": self.model_name, "rank_id": self.rank_id}
        self._m.model_load_time_seconds.labels(**labels).set(seconds)
        self._m.model_load_size_bytes.labels(**labels).set(nbytes)
