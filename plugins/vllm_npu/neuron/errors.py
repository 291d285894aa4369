"""Errors of the Neuron plugin that reach the user."""

from __future__ import annotations

from vllm.exceptions import VLLMValidationError


class NeuronRequestError(VLLMValidationError, ValueError):
    """A request asks for something the Neuron worker does not do (HTTP 400 naming it).

    A ``VLLMValidationError`` subclass: vLLM 0.32 re-raises only those from
    ``validate_request``; anything else becomes an HTTP 500.
    """


class NeuronWorkerError(RuntimeError):
    """The Neuron worker cannot serve as configured (the message names the values)."""


class NeuronDeviceError(NeuronWorkerError):
    """A NEFF execution failed again after the one retry (the runtime's error is chained)."""
