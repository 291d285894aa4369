"""The one retry policy of every NPU worker: a device call that fails with one of its runtime's
own device-error types is retried once; a second such failure raises the device's "failed twice"
error chained to it; anything else propagates at once, with its traceback.

So a deterministic bug (a shape the graph was not compiled for, a ``ValueError`` of bad input,
a ``NotImplementedError``) surfaces as itself, not as "the device failed twice". A retry is exact
because every device call rewrites the same KV positions from the same inputs.

Each device names its types (:class:`DeviceRetry` instances live beside each worker):

========  =========================================  =====================================
device    retried (the runtime's device errors)      never retried
========  =========================================  =====================================
MBLT      ``qbruntime.QbRuntimeError``
RBLN      ``RuntimeError`` (rebel's C++ core raises   ``NotImplementedError``,
          its runtime failures as RuntimeError)        ``RecursionError``, the plugin's own
                                                       errors (recompiles, bad plans)
Neuron    ``nrtpy``'s ``NrtError`` (NRT status         ``NrtpyError`` (a misuse of the
          errors such as ``NRT_FAILURE``)              binding: a wrong shape or dtype)
========  =========================================  =====================================
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

__all__ = ["DeviceRetry", "first_line"]

_T = TypeVar("_T")


def first_line(exc: BaseException) -> str:
    """The first line of ``str(exc)`` (the runtime's detail stays in the chained traceback)."""
    text = str(exc)
    return text.splitlines()[0] if text else type(exc).__name__


def _itself(exc: BaseException) -> BaseException:
    return exc


@dataclass(frozen=True)
class DeviceRetry:
    """Retry once, only on the runtime's own device-error types.

    Attributes:
        device: the name in the log line and the message (``MBLT``, ``RBLN``, ``Neuron``); the
            line goes to the device's logger, ``vllm.vllm_npu.<device in lower case>``.
        device_errors: the runtime's device-error types; only these are retried.
        failed_twice: raised, chained to the second failure, when the retry fails too.
        never: subclasses of ``device_errors`` that are never retried (a deterministic bug).
        cause_of: maps a raised exception to the one to classify (RBLN's vllm path: the
            innermost cause, as torch.compile wraps the backend's error).
    """

    device: str
    device_errors: tuple[type[BaseException], ...]
    failed_twice: type[Exception]
    never: tuple[type[BaseException], ...] = (NotImplementedError, RecursionError)
    cause_of: Callable[[BaseException], BaseException] = field(default=_itself)

    def is_device_error(self, exc: BaseException) -> bool:
        """Whether ``exc`` (through :attr:`cause_of`) is one the policy retries."""
        cause = self.cause_of(exc)
        return isinstance(cause, self.device_errors) and not isinstance(cause, self.never)

    def call(self, what: str, fn: Callable[[], _T], *, where: str = "",
             on_retry: Callable[[], None] | None = None, may_retry: Callable[[], bool] | None = None) -> _T:
        """``fn()``, retried once on a device error.

        Args:
            what: the call, for the log line and the message (``prefill of 12 tokens``).
            where: appended after "failed" (``on slots [(0, 1)]``).
            on_retry: called once before the retry (a stats counter).
            may_retry: asked before the retry; False re-raises the first failure (RBLN's vllm
                path before warm-up finished, when a failure is a compile, not the device).

        Raises:
            failed_twice: the retry failed with a device error too (chained to it).
            Exception: any other failure of either call, unchanged.
        """
        try:
            return fn()
        except Exception as first:
            if not self.is_device_error(first) or (may_retry is not None and not may_retry()):
                raise
            if on_retry is not None:
                on_retry()
            logging.getLogger(f"vllm.vllm_npu.{self.device.lower()}").warning(
                "%s %s failed%s; retrying once: %s", self.device, what, where, first_line(self.cause_of(first)))
        try:
            return fn()
        except Exception as second:
            if not self.is_device_error(second):
                raise
            raise self.failed_twice(f"{self.device} {what} failed twice{where}: "
                                    f"{first_line(self.cause_of(second))}") from second
