"""Fixtures shared by the vllm_npu tests."""

from __future__ import annotations

import logging

import pytest


@pytest.fixture
def rbln_caplog(caplog):
    """``caplog`` that also sees the ``vllm.vllm_npu.rbln`` logger at INFO: vLLM's logging
    config stops ``vllm.*`` records from propagating to the root logger caplog listens on
    (once any test of the session imported vLLM)."""
    chain = [logging.getLogger(n) for n in ("vllm", "vllm.vllm_npu", "vllm.vllm_npu.rbln")]
    saved = [lg.propagate for lg in chain]
    for lg in chain:
        lg.propagate = True
    caplog.set_level(logging.INFO, logger="vllm.vllm_npu.rbln")
    try:
        yield caplog
    finally:
        for lg, value in zip(chain, saved):
            lg.propagate = value
