"""effpretrain: memory-efficient LLM pretraining toolkit."""

__version__ = "0.1.0"
