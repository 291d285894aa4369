"""vLLM plugins for NPUs: Mobilint (``mblt``), Rebellions (``rbln``), AWS Neuron (``neuron``)
and the SpacemiT K3 IME2 int4 kernel (``ime2``).

Importing this package imports nothing from vLLM or any vendor SDK; each device subpackage
talks to its vendor runtime's public API only (see docs/architecture.md).
"""
