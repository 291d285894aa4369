"""``rebel.core.torch_compile.rbln_backend``: the torch.compile backend of the ``vllm`` model path.

vllm-rbln imports this name at module level; the simulator does not compile vLLM's own model
code yet.
"""

from __future__ import annotations

from typing import Any

__all__ = ["rbln_backend"]


def rbln_backend(graph: Any, example_inputs: Any, **kwargs: Any) -> Any:
    """Raises:
        NotImplementedError: always (the ``vllm`` model path of ``rbln-sim`` is issue 16).
    """
    raise NotImplementedError(
        "npusim.rbln: the torch.compile backend of the vllm model path is not built yet (issue 16); "
        "use --model-impl transformers")
