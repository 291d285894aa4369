"""Every simulated lab serves one checkpoint (``STANDARD_TINY_OVERRIDES``): the scenarios that
compare each target's answers with the golden decoder then compare the targets with each other
(issue 41: the same structured request gives the same greedy text on ``mblt-sim``, ``rbln-sim``
and ``neuron-sim``; the ``structured_text_digest`` figure shows it in the report)."""

from __future__ import annotations

import hashlib

from npu_conformance.devices.base import STANDARD_TINY_OVERRIDES
from npu_conformance.devices.mblt import MbltLab
from npu_conformance.devices.neuron import NeuronLab
from npu_conformance.devices.rbln import RblnLab


def _digest(model_dir) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(model_dir.iterdir()) if p.is_file()}


def test_the_simulated_labs_serve_one_checkpoint(tmp_path):
    labs = [cls(target, tmp_path / target) for cls, target in
            ((MbltLab, "mblt-sim"), (RblnLab, "rbln-sim"), (NeuronLab, "neuron-sim"))]
    for lab in labs:
        lab.workdir.mkdir(parents=True)
    digests = [_digest(lab.hf_dir()) for lab in labs]
    assert digests[0] == digests[1] == digests[2]
    assert {"config.json", "model.safetensors"} <= set(digests[0])
    assert labs[0].golden().config.head_dim == STANDARD_TINY_OVERRIDES["head_dim"]
