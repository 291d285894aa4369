"""Fixtures shared by the vllm_npu tests."""

from __future__ import annotations

import logging

import pytest


def _device_caplog(caplog, device: str, level: int):
    """``caplog`` that also sees the ``vllm.vllm_npu.<device>`` logger at ``level``: vLLM's
    logging config stops ``vllm.*`` records from propagating to the root logger caplog listens
    on (once any test of the session imported vLLM)."""
    name = f"vllm.vllm_npu.{device}"
    chain = [logging.getLogger(n) for n in ("vllm", "vllm.vllm_npu", name)]
    saved = [lg.propagate for lg in chain]
    for lg in chain:
        lg.propagate = True
    caplog.set_level(level, logger=name)
    try:
        yield caplog
    finally:
        for lg, value in zip(chain, saved):
            lg.propagate = value


@pytest.fixture
def rbln_caplog(caplog):
    """:func:`_device_caplog` of ``vllm.vllm_npu.rbln`` at INFO."""
    yield from _device_caplog(caplog, "rbln", logging.INFO)


@pytest.fixture
def neuron_caplog(caplog):
    """:func:`_device_caplog` of ``vllm.vllm_npu.neuron`` at DEBUG."""
    yield from _device_caplog(caplog, "neuron", logging.DEBUG)
