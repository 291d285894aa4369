"""The Neuron worker (:mod:`vllm_npu.neuron.worker`) driven directly by the shared
:class:`step_driver.Driver`: the cases of ``neuron_worker_cases.py``, run in a fresh interpreter
(:mod:`worker_cases`)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from worker_cases import case_params, check_case  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("case", case_params("neuron"))
def test_worker_case(case, tmp_path_factory):
    check_case("neuron", case, tmp_path_factory)
