"""Request errors of the RBLN plugin (answered with HTTP 400)."""

from __future__ import annotations

from vllm.exceptions import VLLMValidationError


class RblnRequestError(VLLMValidationError, ValueError):
    """A request asks for something the RBLN worker does not do (HTTP 400 naming it).

    A ``VLLMValidationError`` subclass: vLLM 0.32 re-raises only those as they are from
    ``validate_request``; anything else becomes an HTTP 500 with an empty message.
    """
