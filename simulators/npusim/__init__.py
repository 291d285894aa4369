"""npusim: numpy reference simulators of NPU execution models and a golden numpy LLM decoder."""
