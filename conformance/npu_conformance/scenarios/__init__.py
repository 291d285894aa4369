"""Conformance scenarios, one module per subject. Each test taking the ``target`` fixture runs
once per selected target (see ``npu_conformance.plugin``)."""
