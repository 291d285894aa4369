"""The conformance suite: one set of scenarios, run unchanged against every target.

Importing this package imports no vendor SDK and no vLLM (it is also a pytest plugin,
loaded in every pytest run of this environment through the ``pytest11`` entry point).
"""
