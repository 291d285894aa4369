"""``rebel.core``: the torch.compile backend of vllm-rbln's ``vllm`` model path
(:mod:`.torch_compile`) and its compiled-program cache (:mod:`.mega_cache`)."""

from . import mega_cache, torch_compile  # noqa: F401
