"""``rebel.core``: the torch.compile backend of vllm-rbln's ``vllm`` model path."""
